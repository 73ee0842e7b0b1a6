"""The golden tool-use and Responses cases are what vLLM 0.33.0 renders now.

``tests/fixtures/tools/cases.json`` (checked by the main suite's
``tests/test_prompts_tools.py``) is rendered again here by vLLM's own front
end (:mod:`tests.vllm_tier.tool_cases`) from the same request bodies, and
must be the same file: a case whose ids, hashes or refusal moved, or a
request added to ``requests.json`` without regenerating, fails here.
"""

from __future__ import annotations

import json

from tests.vllm_tier.tool_cases import FIXTURES, render_all


def test_the_checked_in_cases_are_what_vllm_renders() -> None:
    requests = json.loads((FIXTURES / "requests.json").read_text())
    rendered = json.loads(json.dumps(render_all(requests), ensure_ascii=False))
    checked_in = json.loads((FIXTURES / "cases.json").read_text())
    assert [c["name"] for c in rendered["cases"]] == [c["name"] for c in checked_in["cases"]]
    for now, then in zip(rendered["cases"], checked_in["cases"], strict=True):
        assert now == then, (now["model"], now["name"])
    assert rendered == checked_in
    assert sum("token_ids" in c for c in rendered["cases"]) >= 60
