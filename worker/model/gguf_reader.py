"""gguf's GGUFReader, with metadata arrays read in one pass.

gguf's reader makes numpy memmap views for every element of a metadata array, two per string: the real Gemma 3
270M's 262,144-token vocabulary (its tokens, scores and token types) took 12 of its 19 s load, where llama.cpp's
server is up in 1 s; a Qwen file's 151,387 merges cost as much again. Here an array of numbers is one view and
an array of strings one memoryview slice a string, which `ReaderField.contents()` reads as it reads gguf's own
parts (`tobytes()` on each). Every other field and the tensors are gguf's.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType


class FastArraysReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, start = GGUFValueType(int(item_type[0])), orig_offs + 12
        if item == GGUFValueType.STRING:
            strings, end = self._strings(start, int(count[0]))
            data = list(range(2, 2 + len(strings)))  # the parts that hold values: each string's bytes
            return end - orig_offs, [item_type, count, *strings], data, [GGUFValueType.ARRAY, item]
        numbers = self.gguf_scalar_to_np.get(item)
        if numbers is None:  # an array of arrays: gguf's way
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(start, numbers, int(count[0]))
        return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY, item]

    def _strings(self, offset: int, count: int) -> tuple[list[memoryview], int]:
        """`count` strings (each a u64 length, then its bytes) from `offset`, and the offset after them."""
        data = memoryview(self.data)
        order = "big" if (self.byte_order == "S") == (np.little_endian) else "little"
        strings = []
        for _ in range(count):
            length = int.from_bytes(data[offset : offset + 8], order)
            strings.append(data[offset + 8 : offset + 8 + length])
            offset += 8 + length
        return strings, offset
