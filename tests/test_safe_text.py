"""Names the user chose, made safe: on one line, or as a Python identifier."""

from __future__ import annotations

from partc.safe_text import identifier, one_line


def test_one_line_writes_control_characters_as_escapes():
    assert one_line("odd\nimport os") == "odd\\nimport os"
    assert one_line("a\r\x1b[31m\u2028b\tc") == "a\\r\\x1b[31m\\u2028b\\tc"
    assert one_line("blocks.0 <b> é") == "blocks.0 <b> é"


def test_identifier_is_always_one():
    cases = {"0": "_0", "a-b": "a_b", "class": "_class", "": "_", "blocks.0": "blocks_0",
             "x\ny": "x_y", "é": "é", "Stage0": "Stage0"}
    for name, expected in cases.items():
        assert identifier(name) == expected and identifier(name).isidentifier()
    assert identifier("\u0301a").isidentifier()   # a combining mark cannot start a name
