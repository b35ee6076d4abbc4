"""The op schema is the one place ops are enumerated: everything else is derived from it or checked against it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import ggml_py
from ggml_py.ir import ops, schema
from ggml_py.runtime import alloc, native
from ggml_py.testing import ALL_OPS, cases

ROOT = Path(__file__).resolve().parents[1]
# the kernels themselves may name the ops they implement
KERNEL_FILES = {"backends/ggml_py_numpy/kernels.py"}


def test_numpy_kernels_are_exactly_the_compute_ops() -> None:
    from ggml_py_numpy.kernels import KERNELS

    assert set(KERNELS) == set(schema.COMPUTE_OPS)


def test_derived_tables() -> None:
    assert alloc.INPLACE_OPS == {o.name for o in schema.OPS_LIST if o.inplace}
    assert set(ALL_OPS) == set(schema.COMPUTE_OPS)
    assert len(set(schema.ABI_IDS.values())) == len(schema.ABI_IDS)  # ids are unique
    for o in schema.OPS_LIST:  # parameters fit the ABI's slots
        assert sum(p.n_slots for p in o.params) <= schema.MAX_OP_PARAMS


def test_every_node_carries_exactly_its_schema_params() -> None:
    """Every kit case builds its graph through ops.py, which asserts the params against the schema."""
    seen = set()
    for c in cases():
        for t in c.build().outputs:
            stack = [t]
            while stack:
                n = stack.pop()
                if n.op and n.op not in schema.VIEW_OPS:
                    assert tuple(n.params) == schema.OPS[n.op].param_names, n.op
                    seen.add(n.op)
                stack.extend(s for s in n.src if s is not None)
    assert seen == set(schema.COMPUTE_OPS)


def test_header_is_generated_from_the_schema() -> None:
    text = (Path(ggml_py.get_include()) / "ggml_py" / "backend_abi.h").read_text()
    assert schema.render_header(text) == text, "run `python -m ggml_py.ir.schema header`"
    r = subprocess.run([sys.executable, "-m", "ggml_py.ir.schema", "header", "--check"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert native.cdef_from_header(text).count("enum ggml_py_op") == 1  # the loader parses the header itself
    f = native.ffi()
    ids = {k.removeprefix("GGML_PY_OP_"): v for k, v in f.typeof("enum ggml_py_op").relements.items()}
    assert {k: v for k, v in ids.items() if k not in ("NONE", "COUNT")} == schema.ABI_IDS
    for o in schema.OPS_LIST:
        for p in o.params:
            assert native.const(f"GGML_PY_P_{o.name}_{p.name.upper()}") == o.slot(p.name)


def test_what_a_minor_version_added_is_marked_with_its_neutral_value() -> None:
    """A parameter or optional source added by a later ABI minor says which (at most the header's) and, for a
    parameter, the value that computes what the op did before; the builders' defaults are those values, so a node
    that uses none of the additions is offered to every 2.x plugin (runtime/native/backend.py)."""
    minor = native.abi_version()[1]
    for o in schema.OPS_LIST:
        for p in o.params:
            assert (p.since == 0) == (p.neutral is None) and p.since <= minor, (o.name, p)
        optional = {r.rstrip("?") for r in o.srcs if r.endswith("?")}
        assert set(o.srcs_since) <= optional and all(v <= minor for v in o.srcs_since.values()), o.name
    x, pos = ggml_py.input((2, 1, 8)), ggml_py.input((2,), ggml_py.I32)
    rope = schema.OPS["ROPE"]
    assert rope.abi_minor(ops.rope(x, pos, 8).params, [True, True, False]) == 0
    assert rope.abi_minor(ops.rope(x, pos, 8, ext_factor=1.0).params, [True, True, False]) == 2
    assert rope.abi_minor(ops.rope(x, pos, 8).params, [True, True, True]) == 2


def test_source_layouts_are_the_schemas_in_the_header_too() -> None:
    """Each op's `layout` names its own sources and only ROWS or CONTIGUOUS (ANY is the default); the header's
    GGML_PY_LAYOUT_<OP> holds them, 2 bits per source; has_layout judges as ggml does (size-1 dims have no stride)."""
    for o in schema.OPS_LIST:
        assert set(o.layout) <= set(o.roles), o.name
        assert set(o.layout.values()) <= {schema.ROWS, schema.CONTIGUOUS}, o.name
        if o.abi_id is not None:
            want = sum(schema.LAYOUTS.index(o.requires(r)) << 2 * j for j, r in enumerate(o.roles))
            assert native.const(f"GGML_PY_LAYOUT_{o.name}") == want, o.name
    assert [native.const(f"GGML_PY_LAYOUT_{k.upper()}") for k in schema.LAYOUTS] == [0, 1, 2]
    f32, q8 = ggml_py.F32, ggml_py.Q8_0
    dense, rows = schema.CONTIGUOUS, schema.ROWS
    assert schema.has_layout(dense, (3, 4), (16, 4), f32) and schema.has_layout(dense, (1, 4), (999, 4), f32)
    assert not schema.has_layout(dense, (3, 4), (20, 4), f32) and schema.has_layout(rows, (3, 4), (20, 4), f32)
    assert not schema.has_layout(rows, (4, 3), (4, 16), f32) and schema.has_layout(rows, (4, 1), (4, 16), f32)
    assert schema.has_layout(dense, (2, 64), (68, 34), q8) and not schema.has_layout(dense, (2, 64), (102, 34), q8)
    x = ggml_py.input((33, 7))
    assert schema.unmet_layouts(ops.add(ggml_py.input((7, 33)), ops.transpose(x))) == []
    (why,) = schema.unmet_layouts(ops.add(ops.transpose(x), ggml_py.input((7, 33))))
    assert why.startswith("ADD's a must be contiguous in its rows")


def header_lists(text: str) -> dict[str, list[str]]:
    """The X-macro lists of the header, GGML_PY_OPS_<LIST>(X), parsed from its C text: {LIST: [op, ...]}."""
    text = text.replace("\\\n", " ")  # join continued lines
    return {m[1]: re.findall(r"X\((\w+)\)", m[2]) for m in re.finditer(r"#define GGML_PY_OPS_(\w+)\(X\)(.*)", text)}


def test_header_lists_are_the_schemas() -> None:
    text = (Path(ggml_py.get_include()) / "ggml_py" / "backend_abi.h").read_text()
    by_id = sorted(schema.ABI_IDS, key=schema.ABI_IDS.__getitem__)
    expected = {
        "COMPUTE": by_id,
        "UNARY": [n for n in by_id if schema.OPS[n].family == "unary"],
        "BINARY": [n for n in by_id if schema.OPS[n].family == "binary"],
        "GLU": [n for n in by_id if schema.OPS[n].family == "glu"],
        "TRANSCENDENTAL": [n for n in by_id if schema.OPS[n].transcendental],
    }
    assert header_lists(text) == expected
    assert all(expected.values())


# How C code may name an op of a family: only in the head of its own math's specialisation (k_elementwise.cpp).
_SPECIALISATION = re.compile(r"\b(?:Unary|Binary|Glu)Op<GGML_PY_OP_(\w+)>")
_CASE_RUN = re.compile(r"(?:case\s+GGML_PY_OP_\w+\s*:\s*){2,}")


def test_csrc_takes_op_families_from_the_header_lists() -> None:
    """No C/C++ file lists the ops of a family or a class by hand: kernel tables, validation and cost switches
    iterate the header's X-macro lists."""
    lists = header_lists((Path(ggml_py.get_include()) / "ggml_py" / "backend_abi.h").read_text())
    family = set(lists["UNARY"]) | set(lists["BINARY"]) | set(lists["GLU"])
    classes = {k: set(v) for k, v in lists.items() if k != "COMPUTE"}
    found = []
    specialised = set()
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cpp", ".c"):
            continue
        text = path.read_text()
        specialised |= set(_SPECIALISATION.findall(text))
        rel = path.relative_to(ROOT)
        for m in re.finditer(r"GGML_PY_OP_(\w+)", _SPECIALISATION.sub("", text)):
            if m[1] in family:
                found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1} names {m[1]}")
        for m in _CASE_RUN.finditer(text):  # case labels of two ops of one list: that list written by hand
            ops = re.findall(r"GGML_PY_OP_(\w+)", m[0])
            for k, members in classes.items():
                if len(members.intersection(ops)) >= 2:
                    found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1} lists {k} ops by hand: {ops}")
    assert found == []
    assert family <= specialised  # the check above sees every family op's math


def test_docs_list_every_op_with_its_params() -> None:
    """docs/ops.md names every op, except the unary family's, which are documented by their OpDef.doc (what
    `python -m ggml_py.ir.schema ops` prints and the builder's docstring), so that adding one touches no doc page."""
    text = (ROOT / "docs" / "ops.md").read_text()
    assert "python -m ggml_py.ir.schema ops" in text
    listing = schema.render_ops_table()
    for o in schema.OPS_LIST:
        assert f"| `{o.name}` |" in listing
        if o.family == "unary":
            assert o.doc, f"{o.name} needs a doc (its formula)"
            builder = getattr(ops, o.name.lower())
            assert builder.__doc__ and o.name in builder.__doc__
            continue
        assert f"`{o.name}`" in text, f"docs/ops.md does not mention {o.name}"
        for p in o.params:
            assert f"`{p.name}`" in text, f"docs/ops.md does not mention {o.name}'s parameter {p.name}"


# A choice of test data, not a definition: the unary ops whose results at 0, inf and NaN IEEE fixes exactly.
SELECTIONS = {("ggml_py/testing/cases.py", "_SPECIAL_OPS")}


def _literals_naming_ops(path: Path, rel: str) -> list[int]:
    """Lines of tuple/list/set/dict literals that name 4 or more ops (an enumeration written by hand)."""
    names = set(schema.OPS)
    out = []
    tree = ast.parse(path.read_text())
    skip = {id(a.value) for a in ast.walk(tree) if isinstance(a, ast.Assign) and any(
        isinstance(t, ast.Name) and (rel, t.id) in SELECTIONS for t in a.targets)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            found = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
            if len(found) >= 4:
                out.append(node.lineno)
    return out


def test_ops_are_enumerated_by_hand_in_one_place() -> None:
    places = {}
    assert _literals_naming_ops(ROOT / "backends/ggml_py_numpy/kernels.py", "")  # the check finds a real table
    for folder in ("ggml_py", "backends"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel not in KERNEL_FILES and _literals_naming_ops(path, rel):
                places[rel] = _literals_naming_ops(path, rel)
    assert places == {}, places  # schema.py itself is a table of OpDef(...) calls
    # the C side takes its op ids and names from the generated header only
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".h", ".cpp", ".c"):
            assert not re.search(r'"(ADD|MUL_MAT|SOFT_MAX)"', path.read_text()), path


def test_docs_show_the_kits_thresholds_and_layouts_as_the_cases_have_them():
    """docs/ops.md and docs/writing-a-backend.md hold the tables thresholds.block() and layouts.block() make from
    the schema and the kit's cases: a threshold or a source's layout changed there and not in the docs fails here."""
    from ggml_py.testing import layouts, thresholds

    for doc in ("ops.md", "writing-a-backend.md"):
        text = (ROOT / "docs" / doc).read_text()
        for gen in (thresholds, layouts):
            name = gen.__name__.rsplit(".", 1)[1]
            assert text.count(gen.BEGIN) == 1, f"docs/{doc} has no (or two) blocks of {name}"
            start = text.index(gen.BEGIN)
            end = text.index(gen.END, start) + len(gen.END)
            assert text[start:end] == gen.block(), (
                f"docs/{doc}'s table is out of date: paste `python -m ggml_py.testing.{name}`")
    # what the docs claim in words agrees with the table
    table = thresholds.thresholds_table()
    assert "| `MUL_MAT` | 1e-10: F32 F16 BF16; 5e-4:" in table and "| `FLASH_ATTN_EXT` | 5e-4 |" in table
