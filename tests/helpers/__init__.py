"""Test helpers: in-process and forked launches, spies and measurement scripts run by the tests."""
