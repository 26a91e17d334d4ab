"""FastArraysReader reads every field and tensor as gguf's own GGUFReader does, in a fraction of the time."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from worker.model.gguf_reader import FastArraysReader
from worker.model.loader import default_model_path


def _same_as_gguf(path: pathlib.Path) -> None:
    theirs, ours = gguf.GGUFReader(str(path)), FastArraysReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
        assert ours.fields[name].types[0] == field.types[0], name
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, their in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == their.tensor_type and mine.shape.tolist() == their.shape.tolist()
        assert mine.data.shape == their.data.shape and np.array_equal(mine.data, their.data)


def test_every_kind_of_metadata_array_reads_as_gguf_reads_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "héllo ▁wörld", "\n", "x" * 300])
    writer.add_array("test.empty", [])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.number", 7)
    writer.add_tensor("weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_gguf(path)
    assert FastArraysReader(str(path)).fields["test.strings"].contents()[2] == "héllo ▁wörld"


@pytest.mark.slow  # reads a 49,152-token vocabulary twice with gguf's reader (~4 s)
def test_the_default_model_reads_as_gguf_reads_it() -> None:
    _same_as_gguf(default_model_path())
