"""Evals: the evaluator that runs them, eval loss, generation evals with their scorers, and the forgetting matrix
across stages."""
