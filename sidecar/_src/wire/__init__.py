"""What crosses a process boundary: protobuf, the value codec, socket framing."""
