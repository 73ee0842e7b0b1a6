"""The golden tool-use and Responses cases are what this vLLM release renders now.

``tests/fixtures/tools/cases.json`` (checked by the main suite's
``tests/test_prompts_tools.py``) is rendered again here by vLLM's own front
end (:mod:`tests.vllm_tier.tool_cases`) from the same request bodies. On the
release that recorded it, it must be the same file: a case whose ids, hashes or
refusal moved, or a request added to ``requests.json`` without regenerating,
fails here. On every other supported release, every case the file has tokens for
must give the same tokens and hashes; what that release serves differently
besides (0.34 serves ``tools: []`` as no tools, which 0.33 refuses, and words some
refusals otherwise) is printed, not failed.
"""

from __future__ import annotations

import json

import vllm

from tests.vllm_tier.tool_cases import FIXTURES, render_all


def _by_case(cases: dict) -> dict[tuple[str, str], dict]:
    return {(c["model"], c["name"]): c for c in cases["cases"]}


def test_the_checked_in_cases_are_what_vllm_renders() -> None:
    requests = json.loads((FIXTURES / "requests.json").read_text())
    rendered = json.loads(json.dumps(render_all(requests), ensure_ascii=False))
    checked_in = json.loads((FIXTURES / "cases.json").read_text())
    now, then = _by_case(rendered), _by_case(checked_in)
    assert now.keys() == then.keys()
    tokens = [key for key, case in then.items() if "token_ids" in case]
    assert len(tokens) >= 60
    for key in tokens:
        assert now[key] == then[key], key
    if vllm.__version__ == checked_in["vllm_version"]:
        assert rendered == checked_in
    else:
        moved = sorted(key for key in then if now[key] != then[key])
        print(f"\nvLLM {vllm.__version__} serves {len(moved)} refused cases otherwise: {moved}")
