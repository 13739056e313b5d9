"""vLLM's chat rendering options through the model's template: ``continue_final_message`` (go on
with a last assistant message instead of opening a new turn), ``add_generation_prompt`` and
``chat_template_kwargs`` (the template's own variables, e.g. Qwen3's ``enable_thinking``), on the
real tokenizer wrapper, the offline ``LLM.chat`` and their refusals."""

from __future__ import annotations

import pytest

from pipeserve.chat_options import check_chat_options
from pipeserve.sampling_params import SamplingParams
from pipeserve.tokenizer import Tokenizer
from tests.checkpoints import save_tiny_tokenizer

# ChatML, with a Qwen3-like switch: without thinking, an empty think block opens the answer.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from transformers import AutoTokenizer
    directory = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(directory)
    hf = AutoTokenizer.from_pretrained(str(directory))
    hf.chat_template = THINKING_TEMPLATE
    return Tokenizer(hf)


def _text(tok: Tokenizer, **kw) -> str:
    return tok.decode(tok.apply_chat_template(**kw), skip_special_tokens=False)


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    text = _text(tokenizer, messages=CHAT, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\nthe quick"
    closed = _text(tokenizer, messages=CHAT, add_generation_prompt=False)
    assert closed == text + "<|im_end|>\n"
    new_turn = _text(tokenizer, messages=CHAT)
    assert new_turn == closed + "<|im_start|>assistant\n"


def test_chat_template_kwargs_reach_the_template(tokenizer):
    messages = CHAT[:1]
    default = _text(tokenizer, messages=messages)
    off = _text(tokenizer, messages=messages, chat_template_kwargs={"enable_thinking": False})
    on = _text(tokenizer, messages=messages, chat_template_kwargs={"enable_thinking": True})
    assert default == on and default.endswith("<|im_start|>assistant\n")
    assert off == default + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("kw, match", [
    ({"continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": CHAT[:1]}, "assistant's"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "cannot set add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "cannot set tools"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "object of template variables"),
])
def test_bad_combinations_are_refused_by_name(tokenizer, kw, match):
    kw = {"messages": CHAT, **kw}
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(**kw)
    with pytest.raises(ValueError, match=match):
        check_chat_options(kw["messages"], kw.get("add_generation_prompt", True),
                           kw.get("continue_final_message", False), kw.get("chat_template_kwargs"))


def test_offline_chat_goes_on_with_the_final_message(tiny_checkpoints):
    """``LLM.chat(continue_final_message=True)`` generates from the open assistant turn: the
    same greedy tokens as ``generate`` on that rendering's ids."""
    from pipeserve.entrypoints.llm import LLM
    llm = LLM(model=str(tiny_checkpoints("llama_tied_gqa")), dtype="float32", kv_cache_memory="16MiB",
              threads_per_stage=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        tok = llm.get_tokenizer()
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=False, continue_final_message=True)
        assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\nthe quick")
        chat = llm.chat(CHAT, params, add_generation_prompt=False, continue_final_message=True)[0]
        plain = llm.generate([{"prompt_token_ids": ids}], params)[0]
        assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == plain.outputs[0].token_ids
        with pytest.raises(ValueError, match="cannot both be true"):
            llm.chat(CHAT, params, continue_final_message=True)
    finally:
        llm.shutdown()


def test_chat_template_flag_takes_a_file_or_the_template_and_refuses_the_rest(tmp_path):
    from pipeserve.chat_options import resolve_chat_template
    path = tmp_path / "t.jinja"
    path.write_text(THINKING_TEMPLATE)
    assert resolve_chat_template(str(path)) == THINKING_TEMPLATE
    assert resolve_chat_template(THINKING_TEMPLATE) == THINKING_TEMPLATE
    with pytest.raises(ValueError, match="no such file, and not a template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template("{% for m in messages %}{{ m['content'] }}")


def test_an_engine_renders_chats_with_the_given_template(tiny_checkpoints, tmp_path):
    from pipeserve.entrypoints.llm import LLM
    path = tmp_path / "brackets.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    llm = LLM(model=str(tiny_checkpoints("llama_tied_gqa")), dtype="float32", kv_cache_memory="16MiB",
              threads_per_stage=1, chat_template=str(path))
    try:
        out = llm.chat(CHAT[:1], SamplingParams(temperature=0, max_tokens=2))[0]
        assert llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False) == \
            "[user]hello world[assistant]"
        once = llm.chat(CHAT[:1], SamplingParams(temperature=0, max_tokens=2),     # this call's own (vLLM's)
                        chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")[0]
        assert llm.get_tokenizer().decode(once.prompt_token_ids, skip_special_tokens=False) == "<hello world>"
        with pytest.raises(ValueError, match="not a valid Jinja template"):
            llm.chat(CHAT[:1], chat_template="{% if x %}")
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="--chat-template"):
        LLM(model=str(tiny_checkpoints("llama_tied_gqa")), dtype="float32", kv_cache_memory="16MiB",
            chat_template=str(tmp_path / "nope.jinja"))
