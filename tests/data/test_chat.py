"""Chat templates against transformers' ``apply_chat_template`` (rendered text, token ids,
``return_assistant_tokens_mask``) on tiny tokenizers of two families built in code: a
Llama-3-style tokenizer (``<|start_header_id|>`` headers, template in ``chat_template.jinja``)
and a Qwen2/ChatML-style one (``<|im_start|>``, template in ``tokenizer_config.json``, NFC
normalizer). The template strings follow the public model cards' formats. Also: the built-in
format, bad templates, templates that rewrite earlier turns, and saving/reloading."""

import json

import numpy as np
import pytest

from jaxlm.data import ByteTokenizer, HFTokenizer
from jaxlm.data.chat import ChatTemplateError, encode_chat
from jaxlm.data.files import Files
from jaxlm.data.encoding import encode
from jaxlm.data.pipeline import DataConfig, train_dataset
from jaxlm.data.tokenizers import load_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

# Meta-Llama-3-8B-Instruct's format.
LLAMA3 = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    r"message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    r"{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# The same rendering with the assistant output (content and <|eot_id|>) in {% generation %}.
LLAMA3_GENERATION = (
    r"{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
    r"message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    r"{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + "
    r"'<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2-7B-Instruct's ChatML format (a default system prompt when the chat has none).
CHATML = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    r"message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same with {% generation %} around the content and <|im_end|> (the newline after it outside).
CHATML_GENERATION = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    r"{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    r"{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5-Instruct's format with tools (multi-line: exercises trim_blocks / lstrip_blocks and tojson).
CHATML_TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Qwen2.5's tool-call rendering: an assistant message with tool_calls writes each as a
# <tool_call> block after its content.
CHATML_TOOL_CALLS = CHATML_TOOLS.replace("""    {%- elif message.role == "tool" %}""", """\
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}""")
# Qwen3-style: earlier assistant turns (before the last user message) lose their <think> block.
STRIP_THINKING = """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content and loop.index0 < ns.last_query %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{- content + '<|im_end|>' }}{%- endgeneration %}
    {%- else %}
        {{- content + '<|im_end|>' }}
    {%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse. Réponds en français si possible."},
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "I am fine — merci! 日本語も話せます。"},
    {"role": "user", "content": "Grüße aus Köln 🙂 and caf\u0065\u0301?"},  # decomposed é: NFC changes it
    {"role": "assistant", "content": "  Tschüss, café!  "},  # Llama-3's template trims
]
EMPTY_REPLY_CHAT = [
    {"role": "user", "content": "Say nothing."},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "Now say 42."},
    {"role": "assistant", "content": "42"},
]
ASSISTANT_FIRST_CHAT = [  # an opening greeting: the template's header (BOS, a default system prompt) comes first
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Say 42."},
    {"role": "assistant", "content": "42"},
]
PROMPT_CHAT = SYSTEM_CHAT[:4]
CHATS = {"system": SYSTEM_CHAT, "empty_reply": EMPTY_REPLY_CHAT, "assistant_first": ASSISTANT_FIRST_CHAT}
CORPUS = [m["content"] for c in CHATS.values() for m in c] + [
    "system user assistant", "You are a helpful assistant.", "hello there, how are you today", "tools function",
]

FAMILIES = {
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"],
                   config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                   template=LLAMA3, generation=LLAMA3_GENERATION, in_jinja_file=True),
    "chatml": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                   template=CHATML, generation=CHATML_GENERATION, in_jinja_file=False),
}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(path, family: str):
    """A tiny byte-level BPE tokenizer of ``family`` in directory ``path`` (tokenizer.json,
    tokenizer_config.json and, for llama3, chat_template.jinja)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    if family == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if family == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["config"]}
    if spec["in_jinja_file"]:
        (path / "chat_template.jinja").write_text(spec["template"], encoding="utf-8")
    else:
        config["chat_template"] = spec["template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {name: build_tokenizer(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


def load_pair(path):
    return HFTokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, family_dirs):
    """(family, our HFTokenizer, transformers' tokenizer) loaded from the same directory."""
    return (request.param, *load_pair(family_dirs[request.param]))


@pytest.fixture(scope="module")
def chatml(family_dirs):
    return load_pair(family_dirs["chatml"])


def hf_ids(hf, messages, **kw):
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def hf_assistant_mask(hf, messages, template):
    out = hf.apply_chat_template(messages, chat_template=template, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_and_ids_match_transformers(pair, chat, add_generation_prompt):
    family, tok, hf = pair
    messages = CHATS[chat]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_ids(hf, messages, add_generation_prompt=add_generation_prompt)
    if family == "llama3":
        assert ids[0] == tok.bos_id and text.startswith("<|begin_of_text|><|start_header_id|>")
    else:
        assert ("You are a helpful assistant." in text) == (messages[0]["role"] != "system")  # injected system prompt


def test_generation_prompt_matches_transformers(pair):
    family, tok, hf = pair
    ids = tok.apply_chat_template(PROMPT_CHAT, add_generation_prompt=True)
    assert ids == hf_ids(hf, PROMPT_CHAT, add_generation_prompt=True)
    opener = {"llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "chatml": "<|im_start|>assistant\n"}
    assert tok.decode(ids, skip_special_tokens=False).endswith(opener[family])
    assert ids[: len(tok.apply_chat_template(PROMPT_CHAT))] == tok.apply_chat_template(PROMPT_CHAT)


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_assistant_mask_matches_transformers_generation_mask(pair, chat):
    """Our mask (prefix renders, model's own template) == transformers' ``return_assistant_tokens_mask``
    on the same format written with ``{% generation %}`` == ours on that template."""
    family, tok, hf = pair
    messages = CHATS[chat]
    gen_template = FAMILIES[family]["generation"]
    assert hf.apply_chat_template(messages, tokenize=False, chat_template=gen_template) == \
        hf.apply_chat_template(messages, tokenize=False)  # the tags change nothing else
    want_ids, want_mask = hf_assistant_mask(hf, messages, gen_template)
    assert any(want_mask) and not all(want_mask)
    ids, mask = encode_chat(tok, messages)
    assert (ids, mask) == (want_ids, want_mask)
    tagged = HFTokenizer.from_dir(tok._source.parent)
    tagged.set_chat_template(gen_template)
    assert tagged.chat_template.has_generation_tags
    assert encode_chat(tagged, messages) == (want_ids, want_mask)


def test_mask_is_assistant_content_and_end_of_turn(pair):
    """Trained: each assistant content (as the template writes it) and its end-of-turn token;
    not the header, not the newline after the end of the turn, not other roles."""
    family, tok, hf = pair
    ids, mask = encode_chat(tok, SYSTEM_CHAT)
    trained = [i for i, m in zip(ids, mask) if m]
    end = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}[family]
    last = "Tschüss, café!" if family == "llama3" else "  Tschüss, café!  "
    assert tok.decode(trained, skip_special_tokens=False) == f"I am fine — merci! 日本語も話せます。{end}{last}{end}"
    ids, mask = encode_chat(tok, EMPTY_REPLY_CHAT)
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == f"{end}42{end}"


def test_tools_and_tojson_match_transformers(chatml):
    tok, hf = chatml
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Météo d'une ville",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather"}\n</tool_call>'},
                {"role": "tool", "content": '{"temp": "21°C"}'},
                {"role": "assistant", "content": "21°C, sunny."}]
    ours = HFTokenizer.from_dir(tok._source.parent)
    ours.set_chat_template(CHATML_TOOLS)
    for kw in ({"tools": [tool]}, {}):
        text = ours.apply_chat_template(messages, tokenize=False, **kw)
        assert text == hf.apply_chat_template(messages, tokenize=False, chat_template=CHATML_TOOLS, **kw)
        ids = ours.apply_chat_template(messages, add_generation_prompt=True, **kw)
        assert ids == hf_ids(hf, messages, chat_template=CHATML_TOOLS, add_generation_prompt=True, **kw)
    assert '"description": "Météo d\'une ville"' in ours.apply_chat_template(messages, tokenize=False, tools=[tool])
    ids, mask = encode_chat(ours, messages, tools=[tool])
    assert ids == ours.apply_chat_template(messages, tools=[tool])
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == (
        '<tool_call>\n{"name": "get_weather"}\n</tool_call><|im_end|>21°C, sunny.<|im_end|>')


def test_structured_tool_calls_match_transformers_and_train_only_the_actions(chatml):
    """An agentic trajectory (assistant tool_calls, tool results) in a Qwen2.5-style template:
    the text is transformers', and the trained tokens are the tool-call blocks and the answer."""
    tok, hf = chatml
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6*7?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "42"},
                {"role": "assistant", "content": "42"}]
    ours = HFTokenizer.from_dir(tok._source.parent)
    ours.set_chat_template(CHATML_TOOL_CALLS)
    text = ours.apply_chat_template(messages, tokenize=False)
    assert text == hf.apply_chat_template(messages, tokenize=False, chat_template=CHATML_TOOL_CALLS)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>' in text
    ids, mask = encode_chat(ours, messages)
    assert ids == hf_ids(hf, messages, chat_template=CHATML_TOOL_CALLS)
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>42<|im_end|>')


# Phi-3 / Phi-3.5-mini's format: a rendering without a generation prompt ends with eos_token,
# which is not there once later turns follow (written here with ChatML's special tokens).
PHI3_STYLE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|im_start|>system\n' + message['content'] + '<|im_end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|im_start|>user\n' + message['content'] + '<|im_end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|im_start|>assistant\n' + message['content'] + '<|im_end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def _chatml_with_template(family_dirs, d, template):
    """The chatml tokenizer copied to ``d`` with EOS ``<|endoftext|>`` and ``template``, loaded
    by jaxlm and by transformers."""
    import shutil

    shutil.copytree(family_dirs["chatml"], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>",
                                                         "chat_template": template}))
    return load_pair(d)


def test_template_closing_the_conversation_with_eos_trains_every_turn(family_dirs, tmp_path):
    """Each assistant turn is located though rendering the conversation up to it adds an EOS
    that the whole conversation has only at its end (it was refused as a template rewriting
    earlier turns); the ids are transformers'."""
    ours, hf = _chatml_with_template(family_dirs, tmp_path / "phi3", PHI3_STYLE)
    one = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    two = one + [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    user_last = one + [{"role": "user", "content": "thanks"}]
    for chat, trained in ((one, "hello<|im_end|>\n<|endoftext|>"), (two, "hello<|im_end|>fine<|im_end|>\n<|endoftext|>"),
                          (user_last, "hello<|im_end|>")):
        ids, mask = encode_chat(ours, chat)
        assert ids == hf_ids(hf, chat)
        assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == trained


ZEPHYR_STYLE = (  # the generation prompt is written inside the message loop (on loop.last)
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)


def test_an_opening_assistant_turn_of_a_zephyr_style_template_trains_only_its_reply(family_dirs, tmp_path):
    """A template whose generation prompt lives inside the message loop renders an empty
    conversation as "", a prefix of anything: an opening assistant turn's span began at 0 and
    trained its "<|assistant|>" header. The mask now equals transformers' {% generation %} mask."""
    ours, hf = _chatml_with_template(family_dirs, tmp_path / "zephyr", ZEPHYR_STYLE)
    tagged = ZEPHYR_STYLE.replace("{{ '<|assistant|>\n' + message['content'] + eos_token }}",
                                  "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}"
                                  "{% endgeneration %}")
    opening = [{"role": "assistant", "content": "hi there"}, {"role": "user", "content": "hello"},
               {"role": "assistant", "content": "fine"}]
    for chat in (opening, [{"role": "system", "content": "be nice"}] + opening):
        ids, mask = encode_chat(ours, chat)
        ref_ids, ref_mask = hf_assistant_mask(hf, chat, tagged)
        assert ids == ref_ids and mask == ref_mask
        assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == \
            "hi there<|endoftext|>fine<|endoftext|>"


def test_template_that_rewrites_earlier_turns(chatml):
    """Thinking stripped from earlier turns: the prefix method cannot place the first reply and
    says so; with {% generation %} the mask comes from the tags and matches transformers."""
    tok, hf = chatml
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]
    tagged = HFTokenizer.from_dir(tok._source.parent)
    tagged.set_chat_template(STRIP_THINKING, origin="strip_thinking.jinja")
    want_ids, want_mask = hf_assistant_mask(hf, messages, STRIP_THINKING)
    assert encode_chat(tagged, messages) == (want_ids, want_mask)
    assert "add" not in tok.decode([i for i, m in zip(want_ids, want_mask) if m])
    untagged = HFTokenizer.from_dir(tok._source.parent)
    untagged.set_chat_template(STRIP_THINKING.replace("{%- generation %}", "").replace("{%- endgeneration %}", ""),
                               origin="strip_thinking.jinja")
    assert untagged.apply_chat_template(messages) == want_ids
    with pytest.raises(ChatTemplateError, match=r"strip_thinking.jinja: the template renders messages\[:2\] "
                                                r"differently when later messages follow.*\{% generation %\}"):
        encode_chat(untagged, messages)
    ids, mask = encode_chat(untagged, messages[:2])  # one assistant turn: nothing is rewritten
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == \
        "<think>\nadd\n</think>\n\n4<|im_end|>"


def test_special_token_variables_and_save_round_trip(pair, tmp_path):
    family, tok, hf = pair
    assert tok.special_tokens == hf.special_tokens_map
    save_tokenizer(tok, tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text(encoding="utf-8") == FAMILIES[family]["template"]
    again = load_tokenizer(tmp_path)
    hf_again = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.special_tokens == tok.special_tokens
    assert encode_chat(again, SYSTEM_CHAT) == encode_chat(tok, SYSTEM_CHAT)
    assert again.apply_chat_template(PROMPT_CHAT, add_generation_prompt=True) == \
        hf_ids(hf_again, PROMPT_CHAT, add_generation_prompt=True)


def test_messages_rows_train_through_the_template(pair, tmp_path):
    """A jsonl of chats: batches hold the template's tokens and assistant mask."""
    family, tok, hf = pair
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in CHATS.values()) + "\n", encoding="utf-8")
    enc = encode({"messages": SYSTEM_CHAT}, tok)
    want_ids, want_mask = hf_assistant_mask(hf, SYSTEM_CHAT, FAMILIES[family]["generation"])
    np.testing.assert_array_equal(enc["tokens"], want_ids)
    np.testing.assert_array_equal(enc["loss_mask"], want_mask)
    cfg = DataConfig(source=Files(path=str(path), eval_fraction=0.0), seq_len=160, batch_size=len(CHATS))
    batch = next(iter(train_dataset(cfg, tok)))
    rows = {tuple(r[s > 0].tolist()): m[s > 0].tolist()
            for r, m, s in zip(batch["tokens"], batch["loss_mask"], batch["segment_ids"])}
    for chat in CHATS.values():
        ids, mask = hf_assistant_mask(hf, chat, FAMILIES[family]["generation"])
        assert rows[tuple(ids)] == mask


# ----------------------------------------------------------------------------------------
# Bad templates


def test_syntax_error_names_the_file_and_line(tmp_path):
    build_tokenizer(tmp_path, "llama3")
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}\n{% for message in messages %}{{ message.content }}")
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja: chat template syntax error at line 2: "
                                                r"Unexpected end of template.*'endfor'"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages %}{{ messages[0].content }"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json \(chat_template\): chat template syntax error"):
        HFTokenizer.from_dir(tmp_path)
    config["chat_template"] = [{"name": "tool_use", "template": "{{ messages }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"named templates including 'default', got templates \['tool_use'\]"):
        HFTokenizer.from_dir(tmp_path)
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "{{ tools }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = HFTokenizer.from_dir(tmp_path)
    assert named.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_undefined_variable_and_raise_exception_name_the_template(tmp_path):
    build_tokenizer(tmp_path, "chatml")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}\n{{ m.content }}{{ settings.suffix }}\n{% endfor %}", encoding="utf-8")
    tok = HFTokenizer.from_dir(tmp_path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja: rendering the chat template failed at line 2: "
                                                r"UndefinedError: 'settings' is undefined"):
        tok.apply_chat_template(chat)
    assert tok.apply_chat_template(chat, settings={"suffix": "!"}, tokenize=False) == "hi!\nyo!\n"  # a variable
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ message['content'] }}{% endfor %}", encoding="utf-8")
    tok = HFTokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja: the chat template raised an error \(line 1\): "
                                                r"Conversation roles must alternate"):
        encode_chat(tok, chat[::-1])
    assert encode_chat(tok, chat)[0] == tok.encode("hiyo")


def test_sandbox_refuses_unsafe_access(tmp_path):
    build_tokenizer(tmp_path, "chatml")
    tok = HFTokenizer.from_dir(tmp_path)
    tok.set_chat_template("{{ messages.__class__.__mro__ }}", origin="evil.jinja")
    with pytest.raises(ChatTemplateError, match="evil.jinja: rendering the chat template failed"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------------------
# The built-in format (the byte-level default, and a tokenizer.json without a template)


def test_builtin_format_of_the_byte_tokenizer():
    tok = ByteTokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"},
            {"role": "assistant", "content": ""}]
    text = "<|system|>\nbe brief\n<|user|>\nhéllo\n<|assistant|>\nyo\n<|user|>\nmore\n<|assistant|>\n\n"
    assert tok.apply_chat_template(chat, tokenize=False) == text
    ids, mask = encode_chat(tok, chat)
    assert ids == [tok.bos_id] + tok.encode(text) + [tok.eos_id] == tok.apply_chat_template(chat)
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "yo\n\n" and trained[-1] == tok.eos_id
    # ending with a user turn, the EOS is context (a template's rendering trains nothing there either)
    user_last, user_mask = encode_chat(tok, chat[:4])
    assert user_last[-1] == tok.eos_id and not user_mask[-1]
    assert tok.decode([i for i, m in zip(user_last, user_mask) if m]) == "yo\n"
    prompt = tok.apply_chat_template(chat[:4], add_generation_prompt=True)
    assert prompt == [tok.bos_id] + tok.encode(text[: text.rindex("<|assistant|>")] + "<|assistant|>\n")
    enc = encode({"messages": chat}, tok)
    np.testing.assert_array_equal(enc["tokens"], ids)
    np.testing.assert_array_equal(enc["loss_mask"], mask)
    with pytest.raises(ValueError, match="built-in chat format .* takes no tools"):
        encode_chat(tok, chat, tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])


def test_builtin_format_writes_an_assistant_turn_with_tool_calls_as_one_line():
    """Content and every call on the reply's one line, so a policy that stops at the newline
    (`jaxlm.agents.ModelPolicy`) is trained to write its calls before stopping; the trained
    text parses back to the message's content and calls."""
    from jaxlm.agents.parsing import parse_reply

    tok = ByteTokenizer()
    calls = [{"type": "function", "function": {"name": "search", "arguments": {"q": "a\nb"}}},
             {"type": "function", "function": {"name": "open", "arguments": {"id": 3}}}]
    for content in ("Let me look.", ""):
        chat = [{"role": "user", "content": "find it"},
                {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "content": "found"}, {"role": "assistant", "content": "done"}]
        ids, mask = encode_chat(tok, chat)
        trained = tok.decode([i for i, m in zip(ids, mask) if m][:-1])  # without the EOS
        first, second, end = trained.split("\n")
        assert second == "done" and end == ""
        reply = parse_reply(first)
        assert reply.content == content and reply.errors == ()
        assert [c.message_entry() for c in reply.calls] == calls


def test_tokenizer_without_a_template_uses_the_builtin_format(tmp_path):
    build_tokenizer(tmp_path, "chatml")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    chat = EMPTY_REPLY_CHAT
    ids, mask = encode_chat(tok, chat)
    body = [tok.encode(t) for m in chat for t in (f"<|{m['role']}|>\n", m["content"] + "\n")]
    assert ids == [i for piece in body for i in piece] + [tok.eos_id]  # no BOS in this tokenizer
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "\n42\n"
    assert tok.apply_chat_template(chat, tokenize=False) == ByteTokenizer().apply_chat_template(chat, tokenize=False)


# ----------------------------------------------------------------------------------------
# Multi-turn rollout rows (`trainers.rl.multiturn.ChatRows`)


def play_episodes(tok, replies, *, stop):
    """Two episodes: the environment's messages, then the "policy" reply (ids given as
    ``encode(text)`` + ``[stop]`` unless truncated) per turn."""
    from trainers.rl.multiturn import ChatRows

    rows = ChatRows(len(replies), tok, stop_tokens=(stop,))
    for i, episode in enumerate(replies):
        for turn, (env_messages, reply, stopped) in enumerate(episode):
            rows.add_messages(i, env_messages, turn)
            ids = tok.encode(reply) + ([stop] if stopped else [])
            assert rows.add_reply(i, ids, [-0.5] * len(ids), turn) == reply
    return rows


EPISODES = [
    [(SYSTEM_CHAT[:2], SYSTEM_CHAT[2]["content"], True), ([SYSTEM_CHAT[3]], "Tschüss, café!", True)],
    [(EMPTY_REPLY_CHAT[:1], "", True), ([EMPTY_REPLY_CHAT[2]], "42 and", False)],  # the last reply is truncated
]


def test_chat_rows_are_the_conversation_tokens_and_mask(pair):
    family, tok, hf = pair
    gen_template = FAMILIES[family]["generation"]
    rows = play_episodes(tok, EPISODES, stop=tok.eos_id)
    out = rows.rows(200, tok.pad_id)
    for i, episode in enumerate(EPISODES):
        n = len(rows.tokens[i])
        want_ids, want_mask = hf_assistant_mask(hf, rows.messages[i], gen_template)
        assert out["tokens"][i, :n].tolist() == want_ids[:n]
        trained = out["loss_mask"][i, :n].tolist()
        if episode[-1][2]:  # the last reply stopped: the row is the conversation up to its end of turn
            assert trained == want_mask[:n]
            assert tok.decode(want_ids[n:], skip_special_tokens=False) == ("\n" if family == "chatml" else "")
        else:  # truncated: the row ends with what was sampled; the template's end of turn is not in it
            assert trained == want_mask[:n] and want_mask[n] and not any(want_mask[n + 1:])
        turns = out["turn"][i, :n]
        assert sorted(set(turns.tolist())) == [0, 1] and np.all(np.diff(turns) >= 0)
        np.testing.assert_array_equal(out["sampler_logp"][i, :n] != 0, trained)
    # The environment closes a truncated turn: its end-of-turn token is context, then the next prompt.
    rows.add_messages(1, [{"role": "user", "content": "Go on."}], 2)
    want_ids = hf_ids(hf, rows.messages[1], add_generation_prompt=True)
    assert rows.tokens[1] == want_ids
    _, want_mask = hf_assistant_mask(hf, rows.messages[1], gen_template)
    policy = rows.policy[1]
    assert [i for i, p in enumerate(policy) if p] == [i for i, m in enumerate(want_mask) if m][:-1]  # all but it
    assert tok.decode([rows.tokens[1][i] for i, p in enumerate(policy) if p], skip_special_tokens=False) == \
        f"{tok.decode([tok.eos_id], skip_special_tokens=False)}42 and"


def test_chat_rows_in_the_builtin_format():
    tok = ByteTokenizer()
    rows = play_episodes(tok, EPISODES, stop=tok.eos_id)
    stream = rows.tokens[0]
    assert stream[0] == tok.bos_id
    text = tok.decode(stream)
    assert text == ("<|system|>\n" + SYSTEM_CHAT[0]["content"] + "\n<|user|>\n" + SYSTEM_CHAT[1]["content"]
                    + "\n<|assistant|>\n" + SYSTEM_CHAT[2]["content"] + "\n<|user|>\n" + SYSTEM_CHAT[3]["content"]
                    + "\n<|assistant|>\nTschüss, café!")
    policy = [t for t, p in zip(stream, rows.policy[0]) if p]
    assert policy == tok.encode(SYSTEM_CHAT[2]["content"]) + [tok.eos_id] + tok.encode("Tschüss, café!") + [tok.eos_id]
    # a reply that did not end with the format's "\n" (stopped by EOS, or truncated) gets it as context
    rows.add_messages(1, [{"role": "user", "content": "Go on."}], 2)
    assert tok.decode(rows.tokens[1]).endswith("<|assistant|>\n42 and\n<|user|>\nGo on.\n<|assistant|>\n")
    closing = len(rows.tokens[1]) - len(tok.encode("\n<|user|>\nGo on.\n<|assistant|>\n"))
    assert rows.tokens[1][closing] == tok.encode("\n")[0] and not any(rows.policy[1][closing:])
    assert rows.tokens[0][: len(tok.apply_chat_template(SYSTEM_CHAT[:2], add_generation_prompt=True))] == \
        tok.apply_chat_template(SYSTEM_CHAT[:2], add_generation_prompt=True)


def test_chat_rows_refuse_a_template_that_rewrites_earlier_turns(chatml):
    from trainers.rl.multiturn import ChatRows

    tok, _ = chatml
    tok = HFTokenizer.from_dir(tok._source.parent)
    tok.set_chat_template(STRIP_THINKING)
    rows = ChatRows(1, tok)
    rows.add_messages(0, [{"role": "user", "content": "2+2?"}], 0)
    reply = tok.encode("<think>\nadd\n</think>\n\n4") + [tok.eos_id]
    rows.add_reply(0, reply, [0.0] * len(reply), 0)
    with pytest.raises(ValueError, match=r"stream 0: the chat template renders the conversation so far differently "
                                         r"once \['user'\] follow"):
        rows.add_messages(0, [{"role": "user", "content": "3+3?"}], 1)


def test_agent_rollout_streams_render_the_episodes_tools_like_transformers(chatml):
    """The RL agent's streams see the tool specs the agent loop passes, rendered by the chat
    template as transformers (and the inference policy) render them."""
    from trainers.rl.agent import StreamPolicy

    tok, hf = chatml
    ours = HFTokenizer.from_dir(tok._source.parent)
    ours.set_chat_template(CHATML_TOOLS)
    tool = {"type": "function", "function": {"name": "calculator", "description": "integer arithmetic",
                                             "parameters": {"type": "object",
                                                            "properties": {"expression": {"type": "string"}}}}}
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+3?"}]
    want = hf_ids(hf, conversation, chat_template=CHATML_TOOLS, add_generation_prompt=True, tools=[tool])
    policy = StreamPolicy(2, None, None, ours, width=4096, temperature=1.0, top_p=None, rng=None)
    assert policy.count_tokens(0, conversation, [tool]) == len(want)
    assert policy.count_tokens(1, conversation, []) == len(hf_ids(hf, conversation, chat_template=CHATML_TOOLS,
                                                                   add_generation_prompt=True))
    policy.rows.add_messages(0, conversation, 0)
    assert policy.rows.tokens[0] == want
