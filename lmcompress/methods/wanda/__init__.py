from lmcompress.methods.wanda.config import WandaConfig
from lmcompress.methods.wanda.method import Wanda

__all__ = ["Wanda", "WandaConfig"]
