"""Imported once by the tests' fork server (tests/trainer/forked.py ``PRELOAD``): one-time work of a Hugging Face
rank that every forked rank would otherwise repeat, done before they are forked (as the imports are).

transformers builds its table of every model type's checkpoint renamings at a process's first ``from_pretrained``
(``conversion_mapping``, about 0.3-0.8 s of CPU on the shared test host); built here, each rank inherits it."""

from transformers.conversion_mapping import get_checkpoint_conversion_mapping

get_checkpoint_conversion_mapping("llama")
