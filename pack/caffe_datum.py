"""Caffe's ``Datum`` message, built at import from a descriptor: no protoc, no generated code.

The seven fields are those of ``message Datum`` in Caffe's ``caffe.proto``
(proto2, package ``caffe``); Google's protobuf runtime does the wire format, so
an LMDB written by ``convert_imageset`` parses exactly as Caffe parses it.
LMDB values are only ever parsed as this message, never unpickled.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto

#: (name, number, type, label) exactly as in caffe.proto.
DATUM_FIELDS = (
    ("channels", 1, _F.TYPE_INT32, _F.LABEL_OPTIONAL),
    ("height", 2, _F.TYPE_INT32, _F.LABEL_OPTIONAL),
    ("width", 3, _F.TYPE_INT32, _F.LABEL_OPTIONAL),
    ("data", 4, _F.TYPE_BYTES, _F.LABEL_OPTIONAL),  # uint8 pixels, CHW, BGR; or the encoded file
    ("label", 5, _F.TYPE_INT32, _F.LABEL_OPTIONAL),
    ("float_data", 6, _F.TYPE_FLOAT, _F.LABEL_REPEATED),
    ("encoded", 7, _F.TYPE_BOOL, _F.LABEL_OPTIONAL),  # true: `data` is a JPEG/PNG/... file
)


def _build_datum_class():
    proto = descriptor_pb2.FileDescriptorProto(name="dimd/caffe_datum.proto", package="caffe",
                                               syntax="proto2")
    message = proto.message_type.add(name="Datum")
    for name, number, type_, label in DATUM_FIELDS:
        field = message.field.add(name=name, number=number, type=type_, label=label)
        if name == "encoded":
            field.default_value = "false"
    pool = descriptor_pool.DescriptorPool()  # private pool: no clash with a real caffe_pb2
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


#: The message class: ``Datum.FromString(value)``, ``Datum(channels=3, ...).SerializeToString()``.
Datum = _build_datum_class()


def parse_datum(value: bytes):
    """Parse one LMDB value; raises ``google.protobuf.message.DecodeError`` if it is not a Datum."""
    return Datum.FromString(value)
