"""Imported by every script before `models` / `config_registry` pull in torchao: the known harmless
start-up notices of torch and torchao (torchtitan_lite/library_notices.py lists them) are filtered
before they are printed, as train.py does."""
from torchtitan_lite.library_notices import silence_known_library_notices

silence_known_library_notices()
