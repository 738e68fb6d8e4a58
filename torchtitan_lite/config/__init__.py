from torchtitan_lite.config.configurable import Configurable

__all__ = ["Configurable"]
