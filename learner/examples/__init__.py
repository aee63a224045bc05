"""Runnable examples of the learner library (`python -m learner.examples.NAME`)."""
