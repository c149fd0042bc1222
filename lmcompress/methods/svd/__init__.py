from lmcompress.methods.svd.config import SVDConfig
from lmcompress.methods.svd.method import SVD

__all__ = ["SVD", "SVDConfig"]
