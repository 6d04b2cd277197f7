"""gemini's in-memory checkpoints for training frameworks, one module each; each imports
its framework only when used, and none is a dependency of gemini.

* :mod:`launcher.integrations.huggingface`: Hugging Face ``transformers.Trainer``;
* :mod:`launcher.integrations.accelerate`: Hugging Face accelerate's ``Accelerator``;
* :mod:`launcher.integrations.lightning`: Lightning's ``Trainer`` (a callback).
"""
