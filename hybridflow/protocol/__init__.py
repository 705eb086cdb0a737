"""The batch type exchanged between the driver and the workers; see `data_proto.py`."""

from hybridflow.protocol.data_proto import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"]
