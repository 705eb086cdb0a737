"""Typed configuration: schema (frozen dataclasses), one defaults.yaml, loader with overrides, validation."""

from hybridflow.config.loader import ConfigError, load_config, parse_override, to_dict, to_yaml
from hybridflow.config.resolved import Resolved, resolve
from hybridflow.config.schema import Config

__all__ = ["Config", "ConfigError", "Resolved", "load_config", "parse_override", "resolve", "to_dict", "to_yaml"]
