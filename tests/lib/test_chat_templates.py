"""Chat templates judged by their tokens: the inference prompt must be a prefix of the training
conversation. Mistral's [INST] style (no add_generation_prompt), Qwen3's inserted reasoning
block, Gemma's refusal of a system role, template kwargs in the locked recipe, and a template
that is really not a prefix (refused, naming the tokens where the renderings part)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from helpers import run_cli, write_email_study
from helpers.preprocess import TARGET, ex, loss_text, make_pre
from tunelab.core.errors import PreprocessError

# Mistral-Instruct's style: the user turn ends with the cue, the answer follows it directly
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Qwen3's style: an empty reasoning block inside the last assistant turn, and in the
# generation prompt only when enable_thinking is false
QWEN3 = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
# Gemma's style: no system role
GEMMA = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
)
# the generation prompt opens a turn the assistant's own turn does not start with
NOT_A_PREFIX = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ 'Answer: ' + message['content'] + '<|im_end|>' }}{% else %}"
    "{{ '<|im_start|>' + message['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Reply: ' }}{% endif %}"
)


@pytest.fixture
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_mistral_style_template_is_accepted_without_a_generation_prompt(tok):
    tok.chat_template = MISTRAL
    tok.bos_token = "<|endoftext|>"
    pre = make_pre(tok)
    e = ex()
    assert pre.render_prompt(e).endswith(" [/INST]")
    assert pre.render_prompt(e).startswith("<|endoftext|>[INST] Extract the fields")
    enc = pre.encode(e)
    assert enc["input_ids"][: enc["prompt_len"]] == pre.prompt_ids(e)
    assert loss_text(tok, enc) == TARGET + "<|im_end|>"
    assert pre.chat.inserted == ""
    pre.check([enc])


def test_a_prompt_that_is_not_a_prefix_is_refused_naming_the_tokens(tok):
    tok.chat_template = NOT_A_PREFIX
    with pytest.raises(PreprocessError, match="not a prefix") as err:
        make_pre(tok)
    message = str(err.value)
    # the ids and texts of both renderings at the parting point
    assert "they part at token" in message
    assert "'Re'" in message or "Reply" in message or "'R'" in message
    assert "inference prompt [" in message and "training conversation [" in message
    assert "add_generation_prompt" in err.value.hint


def test_inserted_reasoning_block_is_prompt_and_enable_thinking_is_in_the_recipe(tok):
    tok.chat_template = QWEN3
    pre = make_pre(tok)
    assert pre.chat.inserted == "<think>\n\n</think>\n\n"
    assert pre.render_prompt(ex()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    enc = pre.encode(ex())
    assert loss_text(tok, enc) == TARGET + "<|im_end|>"  # the block carries no loss
    assert any("inserts" in n and "no loss" in n for n in pre.describe()["notes"])
    # enable_thinking=false puts the block in the generation prompt itself: nothing inserted
    off = make_pre(tok, preprocess={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.chat.inserted == ""
    assert off.render_prompt(ex()) == pre.render_prompt(ex())
    assert off.describe()["chat_template_kwargs"] == {"enable_thinking": False}
    assert off.template_sha256 != pre.template_sha256  # the kwargs are locked in the recipe
    assert "chat_template_kwargs" not in pre.recipe()


def test_a_template_refusing_the_system_role_gets_the_instruction_in_the_user_turn(tok):
    tok.chat_template = GEMMA
    pre = make_pre(tok, preprocess={"instruction_role": "system"})
    assert pre.chat.instruction_role == "folded"
    assert pre.describe()["instruction_role"] == "folded"
    assert any("refuses a system role" in n for n in pre.notes)
    assert pre.render_prompt(ex()).startswith("<|im_start|>user\nExtract the fields")
    chatml = AutoTokenizer.from_pretrained(tok.name_or_path)
    system = make_pre(chatml, preprocess={"instruction_role": "system"})
    assert system.chat.instruction_role == "system"
    assert system.render_prompt(ex()).startswith("<|im_start|>system\nExtract the fields")
    assert system.template_sha256 != make_pre(chatml).template_sha256


@pytest.mark.slow
def test_mistral_style_template_trains_and_evaluates(tmp_path, tiny_llama_dir, capsys):
    model = tmp_path / "mistral-style"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(MISTRAL)
    root = write_email_study(
        tmp_path / "study",
        model,
        "mistral",
        max_steps=2,
        eval_every_steps=2,
        checkpoint_every_steps=2,
    )
    code, out, err = run_cli(capsys, "inspect", "-s", root)
    assert code == 0, err
    assert "[INST]" in out
    code, out, err = run_cli(capsys, "baseline", "-s", root, "--json")
    assert code == 0, err
    base = json.loads(out)
    code, out, err = run_cli(capsys, "train", "-s", root, "--json")
    assert code == 0, err
    run_id = json.loads(out)["run_id"]
    code, out, err = run_cli(capsys, "eval", run_id, "-s", root, "--json")
    assert code == 0, err
    ev = json.loads(out)
    assert ev["evaluates"] == run_id and ev["spec_sha256"] == base["spec_sha256"]
