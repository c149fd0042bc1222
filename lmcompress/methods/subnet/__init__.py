from lmcompress.methods.subnet.config import SubnetConfig
from lmcompress.methods.subnet.method import Subnet

__all__ = ["Subnet", "SubnetConfig"]
