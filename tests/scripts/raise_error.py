"""A worker whose script raises an uncaught ValueError from a function."""


def fail() -> None:
    raise ValueError("raised by the training script")


fail()
