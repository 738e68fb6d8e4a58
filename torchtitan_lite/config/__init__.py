from torchtitan_lite.config.cli import CliResult, list_configs_text, main_help_text, parse_cli
from torchtitan_lite.config.configurable import Configurable
from torchtitan_lite.config.docs import field_docs, fields_help_text, undocumented_fields
from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.overrides import Override, apply_overrides, overrides_from_dict
from torchtitan_lite.config.toml_io import config_to_dict, config_to_toml, load_toml_overrides

__all__ = [
    "CliResult",
    "ConfigError",
    "Configurable",
    "Override",
    "apply_overrides",
    "config_to_dict",
    "config_to_toml",
    "field_docs",
    "fields_help_text",
    "list_configs_text",
    "load_toml_overrides",
    "main_help_text",
    "overrides_from_dict",
    "parse_cli",
    "undocumented_fields",
]
