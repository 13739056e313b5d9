"""Structured outputs without a model: masks, sampling under a mask, grammars, tool formats."""

from __future__ import annotations

import json

import pytest
import torch

from pipeserve.sampling.inputs import SeqSampling
from pipeserve.sampling.sampler import Sampler
from pipeserve.sampling.token_mask import apply_token_masks, unpack_bitmask
from pipeserve.sampling_params import SamplingParams
from pipeserve.structured import tools as T
from pipeserve.structured.chat_tools import ChatTools, ToolsError, ToolStream
from pipeserve.structured.grammar import grammar_of
from pipeserve.structured.params import GuidedDecodingParams, StructuredOutputsParams

V = 100
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]


def _mask(allowed: list[int], vocab: int = V) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit


def _words(packed: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(packed), dtype=torch.int32)


def _params(mask=None, temperature=0.0, seed=None) -> SeqSampling:
    return SeqSampling(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=seed, step_index=0,
                       allowed_token_mask=None if mask is None else mask.numpy().tobytes())


def test_unpack_bitmask_reads_bit_t_mod_32_of_word_t_div_32():
    allowed = [0, 5, 31, 32, 63, 64, 99]
    got = unpack_bitmask(_mask(allowed), V)
    assert got.shape == (V,) and got.nonzero().flatten().tolist() == allowed


def test_masks_touch_only_their_rows():
    logits = torch.randn(3, V)
    before = logits.clone()
    apply_token_masks(logits, [None, _mask([7, 40]).numpy().tobytes(), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [7, 40]


def test_sampler_only_draws_allowed_tokens_greedy_and_random():
    logits = torch.randn(4, V)
    allowed = [3, 77, 98]
    rows = [_params(_mask(allowed)), _params(), _params(_mask(allowed), 1.0, seed=1),
            _params(_mask([50]), 1.0, seed=2)]
    for _ in range(20):
        out = Sampler(seed=0).sample(logits, rows)
        assert out[0][0] == max(allowed, key=lambda t: logits[0, t]) and out[1][0] == int(logits[1].argmax())
        assert out[2][0] in allowed and out[3][0] == 50
        rows[2].step_index += 1


def test_params_need_exactly_one_constraint_and_take_vllm_names():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="unknown"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ?")
    assert grammar_of(StructuredOutputsParams.from_dict({"json_object": True, "whitespace_pattern": "[ ]?"}))
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
    new = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert old.structured_outputs == new.structured_outputs and old.structured_outputs.kind == "regex"


@pytest.mark.parametrize("spec,words", [
    (StructuredOutputsParams(json={"type": "nope"}), "JSON schema"),
    (StructuredOutputsParams(regex="(("), "regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]{0,2"), "unclosed"),
])
def test_bad_grammars_raise_value_errors_naming_them(spec, words):
    with pytest.raises(ValueError, match=words):
        grammar_of(spec)


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_forced_call_grammars_compile_and_their_text_parses_back(fmt):
    for mode in ("required", "add"):
        grammar_of(StructuredOutputsParams(grammar=T.forced_call_grammar(T.check_tools(TOOLS), mode, fmt)))
    text = T.calls_as_text([{"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}], fmt)
    content, calls = T.parse_tool_calls(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_parse_tool_calls_keeps_plain_text_and_reads_several_calls():
    assert T.parse_tool_calls("The answer is 3.") == ("The answer is 3.", [])
    assert T.parse_tool_calls("{not json") == ("{not json", [])
    text = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>'
    content, calls = T.parse_tool_calls(text)
    assert content == "Sure." and [c.name for c in calls] == ["add", "echo"] and len({c.id for c in calls}) == 2


def test_tool_choice_and_tools_are_checked():
    with pytest.raises(ToolsError) as err:
        ChatTools.of([{"type": "function"}], None, None)
    assert err.value.param == "tools"
    with pytest.raises(ToolsError) as err:
        ChatTools.of(TOOLS, {"type": "function", "function": {"name": "mul"}}, None)
    assert err.value.param == "tool_choice" and "mul" in str(err.value)
    assert ChatTools.of(TOOLS, "none", None).structured() is None
    assert ChatTools.of(TOOLS, "auto", None).structured() is None
    assert ChatTools.of(TOOLS, "required", None).structured().kind == "grammar"


def test_smollm2_prompt_gets_the_tools_and_earlier_calls_as_text():
    tools = ChatTools.of(TOOLS, "auto", "{{ message['content'] }}")   # a template that ignores tools
    assert tools.fmt == "smollm2" and tools.template_tools() is None
    messages = tools.template_messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert '"name": "add"' in messages[0]["content"] and messages[0]["content"].endswith("Be brief.")
    assert messages[2]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    hermes = ChatTools.of(TOOLS, "auto", "{% if tools %}<tool_call>{% endif %}")
    assert hermes.fmt == "hermes" and hermes.template_tools()[0]["function"]["name"] == "add"


def test_tool_stream_holds_a_call_and_streams_plain_text():
    stream = ToolStream(ChatTools.of(TOOLS, "auto", None))
    assert stream.deltas(0, "Hel", False) == ([{"content": "Hel"}], False)
    assert stream.deltas(0, "lo", True) == ([{"content": "lo"}], False)
    assert stream.deltas(1, "<tool_", False) == ([], False)
    deltas, has_calls = stream.deltas(1, 'call>[{"name": "echo", "arguments": {}}]</tool_call>', True)
    assert has_calls and deltas[0]["tool_calls"][0]["index"] == 0
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "echo", "arguments": "{}"}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


# A Hermes / Qwen 2.5 style template: renders ``tools`` and each call's arguments as a dict.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n")


def test_a_template_that_takes_tools_renders_them_and_earlier_calls(tok):
    own = tok.hf_tokenizer.chat_template
    tok.hf_tokenizer.chat_template = HERMES_TEMPLATE
    try:
        tools = ChatTools.of(TOOLS, "auto", tok.chat_template)
        messages = tools.template_messages([
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}])
        text = tok.decode(tok.apply_chat_template(messages, tools=tools.template_tools()),
                          skip_special_tokens=False)
    finally:
        tok.hf_tokenizer.chat_template = own
    assert tools.fmt == "hermes" and '"name": "add"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<|im_start|>tool\n3<|im_end|>" in text


def test_guides_walk_a_choice_and_then_allow_only_eos(tok):
    from pipeserve.engine.guides import Guides
    from pipeserve.sequence import Sequence
    guides = Guides(tok.hf_tokenizer, 49152)
    seq = Sequence("r", 0, [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    plain = Sequence("p", 0, [1, 2], SamplingParams())
    guides.start(seq)
    guides.start(plain)
    assert guides.mask(plain.seq_id) is None and len(guides) == 1
    for token in tok.encode("yes", add_special_tokens=False):
        assert unpack_bitmask(_words(guides.mask(seq.seq_id)), 49152)[token]
        assert guides.advance(seq, token)
    allowed = unpack_bitmask(_words(guides.mask(seq.seq_id)), 49152).nonzero().flatten().tolist()
    assert allowed and set(allowed) <= set(tok.eos_token_ids) | {tok.hf_tokenizer.eos_token_id}
    assert not guides.advance(seq, tok.encode("no", add_special_tokens=False)[0])
    guides.drop(seq.seq_id)
    assert len(guides) == 0


def test_masked_rows_report_raw_logprobs_of_the_chosen_and_top_tokens():
    logits = torch.randn(2, V)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [_params(_mask([3, 9])), _params(_mask([3, 9]))]
    rows[0].num_logprobs, rows[1].num_logprobs = 0, 2
    (t0, lp0, top0), (t1, lp1, top1) = Sampler(seed=0).sample(logits.clone(), rows)
    assert t0 in (3, 9) and abs(lp0 - float(raw[0, t0])) < 1e-5
    assert [t for t, _ in top1] == raw[1].topk(2).indices.tolist()   # the model's top-2, not the grammar's


def test_a_mask_survives_the_wire_format():
    from pipeserve.worker.step_wire import dumps, from_wire
    import json
    sent = _params(_mask([0, 31, 99]))
    got = from_wire(SeqSampling, json.loads(dumps(sent)))
    assert got.allowed_token_mask == sent.allowed_token_mask
    logits = torch.zeros(1, V)
    apply_token_masks(logits, [got.allowed_token_mask])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 99]
