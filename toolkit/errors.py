"""The one exception type users see: a clear, one-paragraph message about their input."""


class ToolkitError(Exception):
    """Bad input (recipe, data, paths, environment). Raised before anything heavy starts.

    The message names the file, line or key and says what to do; the CLI prints it without a traceback.
    """
