"""Top-K rows through verl 0.9.1's Continuous Token builders, in verl's real `ToolAgentLoop`.

verl's agent loops build the response with a Continuous Token builder chosen from the model's `model_type`. Some
builders edit the token stream at a turn boundary, and `align_response_metadata` applies the same edits to
`response_mask` and `response_logprobs`:

- GLM: the generated stop token `<|observation|>` / `<|user|>` is removed and re-rendered as context (mask 0);
- Qwen, MiniMax: a newline is inserted after the generated `<|im_end|>` / `[e~[`;
- Gemma4: `<|tool_response>` is inserted before a tool reply;
- DeepSeek-V4: `<｜end▁of▁sentence｜>` is inserted when generation stopped before it;
- DeepSeek: a trailing `<｜tool▁outputs▁end｜>` (context) is removed before a user message;
- the VL builders do what their text family does (GLM-4.6V as GLM, ...; MiniMax-VL after `<end_of_sentence>`);
  DeepSeek-VL2 re-renders the conversation and appends what follows the runtime prefix.

Specification: after the agent loop, the top-K row at each response position is the rollout engine's row of the
token whose log-prob `rollout_log_probs` holds there, and a zero row where it holds none (prompt-side context,
inserted boundary tokens). Each of the 15 builders verl 0.9.1 ships runs on a character-level tokenizer built here,
with a minimal chat template of its family (same boundary tokens, no download; the VL builders through a text-only
processor); tool calls are written in Hermes format.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import verl
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer import continuous_token, continuous_token_wiring
from verl.utils.tokenizer.deepseek import DeepSeekV4ContinuousTokenBuilder
from verl.utils.tokenizer.tokenizer import normalize_token_ids
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from verl_dppo.patches.agent_loop import trajectory
from verl_dppo.patches._server_common import EXTRA_IDS, EXTRA_LOGPROBS, RolloutTopKError

K = 3
CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


# ------------------------------------------------------------------------------------ tokenizer and templates


def tool_calls(open_, close):
    return "{%- for tc in m.tool_calls or [] -%}" + open_ + "{{ tc.function | tojson }}" + close + "{%- endfor -%}"


def tools_line(open_, close):
    return (
        "{%- if tools -%}"
        + open_
        + "tools:{%- for t in tools %} {{ t.function.name }}{%- endfor -%}"
        + close
        + "{%- endif -%}"
    )


CHATML = (  # Qwen2.5: turns end with <|im_end|>\n; a tool reply is a user turn
    tools_line("<|im_start|>system\n", "<|im_end|>\n")
    + "{%- for m in messages -%}"
    + "{%- if m.role == 'tool' -%}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    + "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    + tool_calls("<tool_call>", "</tool_call>")
    + "<|im_end|>\n{%- endif -%}{%- endfor -%}"
    + "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
TEMPLATES = {
    # no newline after the turn end: the default builder concatenates
    "default": CHATML.replace("<|im_end|>\n", "<|im_end|>"),
    "qwen": CHATML,
    "minimax": CHATML.replace("<|im_start|>", "]~b]").replace("<|im_end|>", "[e~[").replace("]~b]assistant", "]~b]ai"),
    # GLM-4.5: a turn starts with its role token and has no end token; tool replies open with <|observation|>
    "glm": (
        "[gMASK]<sop>"
        + tools_line("<|system|>\n", "")
        + "{%- for m in messages -%}"
        + "{%- if m.role == 'tool' -%}"
        + "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
        + "\n<tool_response>{{ m.content }}</tool_response>"
        + "{%- else -%}<|{{ m.role }}|>\n{{ m.content or '' }}"
        + tool_calls("<tool_call>", "</tool_call>")
        + "{%- endif -%}{%- endfor -%}"
        + "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    ),
    # Gemma4: a tool reply sits inside the model turn, after the <|tool_response> the call's render ends with
    "gemma4": (
        "<bos>"
        + tools_line("<|turn>system\n", "<turn|>\n")
        + "{%- for m in messages -%}"
        + "{%- if m.role == 'tool' -%}response:{{ m.name }}{{ m.content }}<tool_response|>"
        + "{%- elif m.role == 'assistant' -%}<|turn>model\n{{ m.content or '' }}"
        + "{%- if m.tool_calls -%}"
        + tool_calls("<|tool_call>", "<tool_call|>")
        + "<|tool_response>"
        + "{%- else -%}<turn|>\n{%- endif -%}"
        + "{%- else -%}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{%- endif -%}{%- endfor -%}"
        + "{%- if add_generation_prompt and messages[-1].role != 'tool' -%}<|turn>model\n{%- endif -%}"
    ),
    "gptoss": (
        tools_line("<|start|>developer<|message|>", "<|end|>")
        + "{%- for m in messages -%}"
        + "{%- if m.role == 'assistant' and m.tool_calls -%}"
        + tool_calls("<|start|>assistant<|channel|>commentary<|message|>", "<|call|>")
        + "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
        + "{%- elif m.role == 'tool' -%}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
        + "{{ m.content }}<|end|>"
        + "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}{%- endfor -%}"
        + "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
    ),
    # DeepSeek-V3: after tool outputs the model continues directly (no <｜Assistant｜>)
    "deepseek": (
        "<｜begin▁of▁sentence｜>"
        + tools_line("", "")
        + "{%- for m in messages -%}"
        + "{%- if m.role == 'tool' -%}"
        + "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<｜tool▁outputs▁begin｜>{%- endif -%}"
        + "<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
        + "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<｜tool▁outputs▁end｜>{%- endif -%}"
        + "{%- elif m.role == 'assistant' -%}"
        + "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<｜Assistant｜>{%- endif -%}"
        + "{{ m.content or '' }}"
        + tool_calls("<tool_call>", "</tool_call>")
        + "<｜end▁of▁sentence｜>"
        + "{%- elif m.role == 'user' -%}<｜User｜>{{ m.content }}{%- else -%}{{ m.content }}{%- endif -%}"
        + "{%- endfor -%}"
        + "{%- if add_generation_prompt and messages[-1].role != 'tool' -%}<｜Assistant｜>{%- endif -%}"
    ),
    "deepseekv4": None,  # renders with verl's own encoder, not a chat template
    # MiniMax-VL-01's processor template: turns end with <end_of_sentence>\n, and every render ends with the
    # assistant scaffold, asked for or not (verl's builder strips it)
    "minimaxvl": (
        "{%- for m in messages -%}<beginning_of_sentence>"
        + "{%- if m.role == 'assistant' -%}ai name=assistant\n{{ m.content or '' }}"
        + tool_calls("<tool_call>", "</tool_call>")
        + "{%- else -%}{{ m.role }} name={{ m.role }}\n{{ m.content }}{%- endif -%}<end_of_sentence>\n{%- endfor -%}"
        + "<beginning_of_sentence>ai name=assistant\n"
    ),
}
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "]~b]",
    "[e~[",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
    "<beginning_of_sentence>",
    "<end_of_sentence>",
]


def make_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """One token per character (so "\\n" is one token, as Qwen's and MiniMax's builders require), one per special."""
    chars = [chr(i) for i in range(32, 127)] + ["\n", "▁", "｜"]
    vocab = {"<unk>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = TEMPLATES[template]
    return tokenizer


class TextProcessor:
    """What verl's VL builders call on a multimodal processor, for a text-only conversation: its chat template and
    its tokenizer. `image_processor` makes verl treat it as multimodal and pick the family's VL builder."""

    image_processor = object()

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text, images=None, videos=None, return_tensors="pt", **kwargs):
        assert images is None and videos is None
        return {"input_ids": torch.tensor([self.tokenizer.encode(text[0], add_special_tokens=False)])}


class DeepSeekVL2TextProcessor(TextProcessor):
    """DeepSeek-VL2's processor renders a conversation of <|User|> / <|Assistant|> turns (no tool role)."""

    def __call__(self, conversations, images, force_batchify):
        roles = {"<|User|>": "user", "<|Assistant|>": "assistant"}
        messages = [{"role": roles[turn["role"]], "content": turn["content"]} for turn in conversations]
        add_generation_prompt = messages[-1] == {"role": "assistant", "content": ""}
        if add_generation_prompt:
            messages.pop()
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        return SimpleNamespace(input_ids=torch.tensor([normalize_token_ids(ids)]))


# ------------------------------------------------------------------------------------- the builders' families


@dataclass
class Family:
    name: str
    model_type: Optional[str]  # config.json model_type: how verl picks the builder
    builder: type
    turns: list[str]  # the model's generations: a tool call, then the answer
    edits: dict = field(default_factory=dict)  # MergeResult edits verl makes at the tool reply
    template: str = ""  # the chat template (default: the family's name)
    processor: type = None  # a VL builder renders through a multimodal processor

    def make_tokenizer(self):
        return make_tokenizer(self.template or self.name)


CT = continuous_token
QWEN_TURNS = [CALL + "<|im_end|>", "5<|im_end|>"]
GLM_TURNS = ["\n" + CALL + "<|observation|>", "\n5<|user|>"]
GEMMA_TURNS = [CALL + "<tool_call|>", "5<turn|>"]
NEWLINE, REMOVED_STOP = {"inserted_token_ids": ["\n"]}, {"removed_prefix_token_count": 1}
TOOL_RESPONSE = {"inserted_token_ids": ["<|tool_response>"]}
FAMILIES = [
    Family("default", None, CT.ContinuousTokenBuilder, QWEN_TURNS),
    Family("qwen", "qwen2", CT.QwenContinuousTokenBuilder, QWEN_TURNS, NEWLINE),
    Family("minimax", "minimax", CT.MiniMaxContinuousTokenBuilder, [CALL + "[e~[", "5[e~["], NEWLINE),
    Family("glm", "glm4_moe", CT.GLMContinuousTokenBuilder, GLM_TURNS, REMOVED_STOP),
    Family("gemma4", "gemma4", CT.Gemma4ContinuousTokenBuilder, GEMMA_TURNS, TOOL_RESPONSE),
    Family(
        "gptoss",
        "gpt_oss",
        CT.GptOssContinuousTokenBuilder,
        ["<|channel|>commentary<|message|>" + CALL + "<|call|>", "<|channel|>final<|message|>5<|return|>"],
    ),
    Family(
        "deepseek",
        "deepseek_v3",
        CT.DeepSeekContinuousTokenBuilder,
        [CALL + "<｜end▁of▁sentence｜>", "5<｜end▁of▁sentence｜>"],
    ),
    Family(
        "deepseekv4",
        "deepseek_v4",
        DeepSeekV4ContinuousTokenBuilder,
        [CALL, "5<｜end▁of▁sentence｜>"],
        {"inserted_token_ids": ["<｜end▁of▁sentence｜>"]},
    ),
    # vision-language builders on a text-only conversation: their text family's boundary handling
    Family("vldefault", None, CT.VLContinuousTokenBuilder, QWEN_TURNS, template="default", processor=TextProcessor),
    Family("qwenvl", "qwen2_vl", CT.QwenVLContinuousTokenBuilder, QWEN_TURNS, NEWLINE, "qwen", TextProcessor),
    Family(
        "minimaxvl",
        "minimax_vl_01",
        CT.MiniMaxVLContinuousTokenBuilder,
        [CALL + "<end_of_sentence>", "5<end_of_sentence>"],
        NEWLINE,
        processor=TextProcessor,
    ),
    Family(
        "gemma4vl", "gemma4", CT.Gemma4VLContinuousTokenBuilder, GEMMA_TURNS, TOOL_RESPONSE, "gemma4", TextProcessor
    ),
    Family("glm46v", "glm4v", CT.GLM46VContinuousTokenBuilder, GLM_TURNS, REMOVED_STOP, "glm", TextProcessor),
    Family(
        "kimivl", "kimi_vl", CT.KimiVLContinuousTokenBuilder, QWEN_TURNS, template="default", processor=TextProcessor
    ),
]
# DeepSeek-VL2's builder re-renders the whole conversation through its processor, which has no tool role: no
# tool turn is possible with it, so it runs a user turn (test_edits_a_tool_loop_does_not_make).
DEEPSEEK_VL2 = Family(
    "deepseekvl2",
    "deepseek_vl_v2",
    CT.DeepSeekVL2ContinuousTokenBuilder,
    [],
    template="deepseek",
    processor=DeepSeekVL2TextProcessor,
)


def family_named(name: str) -> Family:
    return next(f for f in [*FAMILIES, DEEPSEEK_VL2] if f.name == name)


# ---------------------------------------------------------------------------- a rollout engine and its replies


class ScriptedEngine:
    """Stands in for the vLLM/SGLang server behind verl's `LLMServerClient`: replies with the family's scripted
    generations, each token with a distinct log-prob -n/64 (n counts the tokens generated so far) and its own
    top-K row, [token, n, n + 1] with log-probs [-n/64, -n/64 - 1, -n/64 - 2], as the plugin's server patch puts
    them in `extra_fields`. `row_of` maps a log-prob to the (ids, log-probs) row the engine returned with it."""

    def __init__(self, tokenizer, turns):
        self.generate = self  # verl awaits `server.generate.remote(...)`
        self.replies = [tokenizer.encode(text, add_special_tokens=False) for text in turns]
        self.row_of: dict[float, tuple[list[int], list[float]]] = {}
        self.n = 0

    async def remote(self, *, prompt_ids, sampling_params, **kwargs):
        token_ids = self.replies.pop(0)
        ids = np.zeros((len(token_ids), K), np.int64)
        lps = np.zeros((len(token_ids), K), np.float32)
        for row, token in enumerate(token_ids):
            self.n += 1
            ids[row] = [token, self.n, self.n + 1]
            lps[row] = -self.n / 64 - np.arange(K)
            self.row_of[float(lps[row, 0])] = (ids[row].tolist(), lps[row].tolist())
        return TokenOutput(
            token_ids=token_ids,
            log_probs=lps[:, 0].tolist(),
            extra_fields={"global_steps": 1, EXTRA_IDS: ids, EXTRA_LOGPROBS: lps},
        )


class ScriptedClient(LLMServerClient):
    """verl's real `LLMServerClient.generate` (patched by the plugin to collect the rows), one scripted engine."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    async def _acquire_server(self, request_id, **extra):
        return "engine", self.engine

    def _release_server(self, server_id, request_id=None):
        pass


def add(a: int, b: int) -> int:
    return a + b


ADD_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
)


def compose_config(response_length):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            "ppo_trainer",
            overrides=[
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.multi_turn.format=hermes",
                f"actor_rollout_ref.rollout.response_length={response_length}",
                "actor_rollout_ref.rollout.prompt_length=512",
            ],
        )


def run_tool_loop(family: Family, response_length=256):
    """verl's `ToolAgentLoop` with the family's builder: turn 1 calls `add`, the tool replies, turn 2 answers.
    Returns the `as_dict` fields, the engine, the builder's context-merge results and the tokenizer."""
    tokenizer = family.make_tokenizer()
    config = compose_config(response_length)
    engine = ScriptedEngine(tokenizer, family.turns)
    processor = family.processor(tokenizer) if family.processor else None

    async def scenario():
        loop = ToolAgentLoop(
            DictConfigWrap(config),
            ScriptedClient(config, engine),
            tokenizer,
            processor,
            RLHFDataset,
            DictConfigWrap(config.data),
            hf_model_type=family.model_type,
            tools=ToolListWrap([FunctionTool(name="add", fn=add, tool_schema=ADD_SCHEMA)]),
        )
        assert type(loop.continuous_token_builder) is family.builder
        merges = []
        merge_context_tokens = loop.continuous_token_builder.merge_context_tokens

        def spy(*args, **kwargs):
            merges.append(merge_context_tokens(*args, **kwargs))
            return merges[-1]

        loop.continuous_token_builder.merge_context_tokens = spy
        with trajectory():
            output = await loop.run(sampling_params={}, raw_prompt=list(PROMPT))
            return output, output.as_dict(), merges

    output, fields, merges = asyncio.run(scenario())
    return output, fields, engine, merges, tokenizer


def assert_rows_follow_the_log_probs(fields, engine):
    """At every position, the top-K row is the engine's row of the token whose log-prob sits there (zero if none)."""
    responses, mask = fields["responses"], fields["response_mask"]
    rollout_log_probs = fields["rollout_log_probs"]
    topk_ids, topk_logprobs = fields["rollout_topk_ids"], fields["rollout_topk_logprobs"]
    assert topk_ids.shape == (responses.shape[0], K) and topk_logprobs.shape == (responses.shape[0], K)
    for position in range(responses.shape[0]):
        logprob = float(rollout_log_probs[position])
        if mask[position]:
            ids, lps = engine.row_of[logprob]
            assert ids[0] == responses[position], f"position {position}: the row is another token's"
            assert topk_ids[position].tolist() == ids and topk_logprobs[position].tolist() == lps, position
        else:
            assert logprob == 0.0
            assert not topk_ids[position].any() and not topk_logprobs[position].any(), position


# ------------------------------------------------------------------------------------------------------ tests


def test_every_builder_verl_ships_is_followed():
    """Every builder in verl's registry edits `response_logprobs` through the one `align_response_metadata` the
    plugin follows (none overrides it), and this module runs each of them."""
    builders = set(continuous_token_wiring._CONTINUOUS_TOKEN_BUILDER_REGISTRY.values())
    for builder in builders:
        assert builder.align_response_metadata is continuous_token.ContinuousTokenBuilder.align_response_metadata
    assert builders == {family.builder for family in FAMILIES} | {DEEPSEEK_VL2.builder}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_topk_rows_follow_the_builders_edits_through_a_tool_turn(family):
    output, fields, engine, merges, tokenizer = run_tool_loop(family)
    # the scenario makes the family's boundary edit (else this test would not test it)
    assert len(merges) == 1
    merge = merges[0]
    assert merge.removed_prefix_token_count == family.edits.get("removed_prefix_token_count", 0)
    assert merge.inserted_token_ids == tokenizer.convert_tokens_to_ids(family.edits.get("inserted_token_ids", []))
    generated = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in family.turns)
    # every generated token verl kept as generated (mask 1, its log-prob) carries its own row, in place
    assert int(fields["response_mask"].sum()) == generated - merge.removed_prefix_token_count
    assert_rows_follow_the_log_probs(fields, engine)


def test_glm_stop_token_rendered_as_context_gets_no_row():
    """GLM: the generated `<|observation|>` is dropped from the prefix and re-rendered as the tool reply's first
    token (mask 0, log-prob 0): no row there; the next generated tokens keep theirs."""
    family = family_named("glm")
    output, fields, engine, merges, tokenizer = run_tool_loop(family)
    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    call_length = len(tokenizer.encode(family.turns[0], add_special_tokens=False)) - 1
    assert fields["responses"][call_length] == observation and fields["response_mask"][call_length] == 0
    assert not fields["rollout_topk_ids"][call_length].any()
    assert_rows_follow_the_log_probs(fields, engine)


def test_a_context_merge_verl_discards_is_not_followed():
    """When the tool reply would overflow response_length, `ToolAgentLoop` stops and discards that merge: the GLM
    stop token stays generated (mask 1, its log-prob), and so does its row."""
    family = family_named("glm")
    call_length = len(family.make_tokenizer().encode(family.turns[0], add_special_tokens=False))
    output, fields, engine, merges, tokenizer = run_tool_loop(family, response_length=call_length + 3)
    assert merges[0].removed_prefix_token_count == 1  # made, then discarded by verl
    assert fields["responses"].shape[0] == call_length and bool(fields["response_mask"].all())
    assert_rows_follow_the_log_probs(fields, engine)


USER_TURN = [{"role": "user", "content": "and 4 + 4?"}]


@pytest.mark.parametrize(
    "name, steps, removed",
    [
        # the generated stop token <|user|> is dropped before the user turn
        ("glm", ["\n4<|user|>", USER_TURN, "\n8<|user|>"], ["<|user|>"]),
        # the tool reply's closing <｜tool▁outputs▁end｜> (context) is dropped before the user turn
        (
            "deepseek",
            [CALL + "<｜end▁of▁sentence｜>", [{"role": "tool", "content": "5"}], USER_TURN, "8<｜end▁of▁sentence｜>"],
            ["<｜tool▁outputs▁end｜>"],
        ),
        # the whole conversation re-rendered, the user turn appended after the common prefix: no edit
        ("deepseekvl2", ["4<｜end▁of▁sentence｜>", USER_TURN, "8<｜end▁of▁sentence｜>"], []),
    ],
)
def test_edits_a_tool_loop_does_not_make(name, steps, removed):
    """A user turn after the model's turn, driven through the agent loop's own `ct_merge_assistant_token` /
    `ct_merge_context_msg` (what every verl agent loop calls): a string is a generation, a list a context append."""
    family = family_named(name)
    tokenizer = family.make_tokenizer()
    config = compose_config(256)
    engine = ScriptedEngine(tokenizer, [step for step in steps if isinstance(step, str)])
    client = ScriptedClient(config, engine)
    processor = family.processor(tokenizer) if family.processor else None

    async def scenario():
        loop = ToolAgentLoop(
            DictConfigWrap(config),
            client,
            tokenizer,
            processor,
            RLHFDataset,
            DictConfigWrap(config.data),
            hf_model_type=family.model_type,
            tools=ToolListWrap([]),
        )
        assert type(loop.continuous_token_builder) is family.builder
        messages = list(PROMPT)
        runtime = await loop.ct_build_initial_tokens(messages)
        prompt_length = len(runtime)
        mask, logprobs, merges = [], [], []
        with trajectory():
            for step in steps:
                if isinstance(step, str):
                    reply = await client.generate("r", prompt_ids=runtime, sampling_params={})
                    merge, mask, logprobs = await loop.ct_merge_assistant_token(
                        runtime, reply.token_ids, mask, logprobs, assistant_logprobs=reply.log_probs
                    )
                    content = tokenizer.decode(reply.token_ids, skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": content})
                else:
                    previous, messages = messages, messages + step
                    merge, mask, logprobs = await loop.ct_merge_context_msg(previous, messages, runtime, mask, logprobs)
                    merges.append(merge)
                runtime = merge.token_ids
            output = AgentLoopOutput(
                prompt_ids=runtime[:prompt_length],
                response_ids=runtime[prompt_length:],
                response_mask=mask,
                response_logprobs=logprobs,
                metrics={},
                num_turns=len(steps),
            )
            return output.as_dict(), merges

    fields, merges = asyncio.run(scenario())
    assert merges[-1].removed_prefix_token_count == len(removed)
    assert_rows_follow_the_log_probs(fields, engine)


def test_tokens_verl_merged_that_the_engine_did_not_generate_raise():
    """An agent loop that merges other tokens than the engine returned: refused, naming the mismatch."""
    family = family_named("qwen")
    tokenizer = family.make_tokenizer()
    config = compose_config(256)
    engine = ScriptedEngine(tokenizer, family.turns)
    client = ScriptedClient(config, engine)

    async def scenario():
        loop = ToolAgentLoop(
            DictConfigWrap(config),
            client,
            tokenizer,
            None,
            RLHFDataset,
            DictConfigWrap(config.data),
            hf_model_type=family.model_type,
            tools=ToolListWrap([]),
        )
        runtime = await loop.ct_build_initial_tokens(list(PROMPT))
        with trajectory():
            reply = await client.generate("r", prompt_ids=runtime, sampling_params={})
            edited = list(reply.token_ids)
            edited[0] += 1
            await loop.ct_merge_assistant_token(runtime, edited, [], [], assistant_logprobs=reply.log_probs)

    with pytest.raises(RolloutTopKError, match="not the tokens the rollout engine generated"):
        asyncio.run(scenario())
