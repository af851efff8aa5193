"""Bytes only: the frame a serialized object travels in, a round-1 slot, the tensor table, compression, limits.

Nothing here calls torch.distributed; everything here can be tested on one process with made-up bytes. See
docs/wire-format.md for the layout these modules read and write.
"""
