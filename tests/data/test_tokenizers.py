"""Tokenizers: byte-level round trip for every string; a local tokenizer.json through the
`tokenizers` library, picked up by load_hf."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlm
from jaxlm.data import ByteTokenizer, HFTokenizer
from jaxlm.data.tokenizers import save_tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8")) + 2


def test_byte_tokenizer_rejects_non_text():
    with pytest.raises(TypeError, match="expects str"):
        ByteTokenizer().encode(b"bytes")


def _train_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat", "a dog and a cat", "12 + 30 = 42"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_hf_tokenizer_round_trip(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "tok_rt"
    if not (path / "tokenizer.json").exists():
        path.mkdir(exist_ok=True)
        _train_tokenizer(path)
    tok = HFTokenizer.from_file(path / "tokenizer.json", bos="<s>", eos="</s>")
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_load_hf_picks_up_tokenizer_json(tmp_path):
    _train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=300))
    jaxlm.save_hf(model, tmp_path)
    loaded = jaxlm.load_hf(tmp_path, dtype="float32")
    tok = loaded.tokenizer
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.decode(tok.encode("the cat")) == "the cat"
    # generate() uses it for text prompts and stops at its EOS by default
    out = jaxlm.generate(loaded, ["the cat"], max_new_tokens=3, temperature=0)
    assert isinstance(out.texts[0], str)
    # save_hf writes it back out
    jaxlm.save_hf(loaded, tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").exists()


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer.from_file(tmp_path / "nope.json")


def test_load_hf_picks_up_the_chat_template_and_save_hf_keeps_it(tmp_path):
    _train_tokenizer(tmp_path)
    template = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}" \
               "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    jaxlm.save_hf(jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=300)), tmp_path)
    tok = jaxlm.load_hf(tmp_path, dtype="float32").tokenizer
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]
    assert tok.chat_template.source == template
    ids = tok.apply_chat_template(chat[:1], add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<s>user: the cat</s><s>assistant: "
    assert tok.decode(ids) == "user: the catassistant: "
    ids, offsets = tok.encode_with_offsets("the cat")
    assert ids == tok.encode("the cat") and offsets[0][0] == 0 and offsets[-1][1] == len("the cat")
    jaxlm.save_hf(jaxlm.load_hf(tmp_path, dtype="float32"), tmp_path / "again")
    again = jaxlm.load_hf(tmp_path / "again", dtype="float32").tokenizer
    assert (tmp_path / "again" / "chat_template.jinja").read_text() == template
    assert again.apply_chat_template(chat) == tok.apply_chat_template(chat)


def test_byte_tokenizer_chat_uses_the_builtin_format():
    tok = ByteTokenizer()
    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    assert tok.chat_template is None
    assert tok.apply_chat_template(chat) == tok.encode("<|user|>\n12+30=\n<|assistant|>\n42\n", add_bos=True,
                                                       add_eos=True)
    assert tok.apply_chat_template(chat[:1], add_generation_prompt=True) == tok.encode(
        "<|user|>\n12+30=\n<|assistant|>\n", add_bos=True)


def test_a_list_of_eos_ids_loads_and_every_one_stops_generation(tmp_path):
    """Llama 3 configs list several end ids (``eos_token_id: [..., ...]``): the first is EOS,
    and `generate` stops at any of them by default."""
    _train_tokenizer(tmp_path)
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=300))
    jaxlm.save_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, "<unk>", 7], "bos_token_id": 1}))
    loaded = jaxlm.load_hf(tmp_path)
    tok = loaded.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.extra_eos_ids, tok.stop_ids) == (1, 2, (0, 7), (2, 0, 7))
    free = [int(t) for t in jaxlm.generate(loaded, [[5, 6, 9]], max_new_tokens=12, temperature=0,
                                           stop_tokens=()).tokens[0]]  # greedy, never stopped
    tok.extra_eos_ids = (free[2],)  # its third token becomes an end id too
    want = next(i for i, t in enumerate(free) if t in tok.stop_ids) + 1
    out = jaxlm.generate(loaded, [[5, 6, 9]], max_new_tokens=12, temperature=0)
    assert out.completions()[0] == free[:want]
    with pytest.raises(TypeError, match="neither a token id nor a token string"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json", eos=2.5)


def test_special_ids_outside_the_vocabulary(tmp_path):
    """A negative id (``pad_token_id: -1``, "none" in some conversions) crashed in
    ``id_to_token`` (a bare OverflowError); one past the vocabulary (another model's config)
    was taken as BOS / EOS and written into encoded rows and the stop ids."""
    _train_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": -1}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.pad_named) == (1, 2, 2, False)  # PAD falls back to EOS
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 128009]}))
    with pytest.raises(ValueError, match=r"special token id 128009 is outside the tokenizer's vocabulary "
                                         r"\[0, \d+\) \(named by config.json eos_token_id\)"):
        HFTokenizer.from_dir(tmp_path)


def test_stop_ids_are_the_union_of_every_file_and_survive_a_save(tmp_path):
    """Llama 3.1's layout: ``tokenizer_config.json`` names one EOS string, ``config.json`` and
    ``generation_config.json`` list several ids. The named one is EOS; every listed id stops."""
    _train_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 8]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 0, (0, 2, 8, 7))
    (tmp_path / "again").mkdir()
    save_tokenizer(tok, tmp_path / "again")
    again = HFTokenizer.from_dir(tmp_path / "again")
    assert (again.eos_id, again.stop_ids) == (0, (0, 2, 8, 7))
    # transformers reads the same file: the named EOS string stays its eos_token
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path / "again")
    assert hf.eos_token_id == 0


@pytest.mark.parametrize("layout", ["ids_in_config_only", "special_tokens_map", "bos_null"])
def test_special_tokens_agree_with_transformers(tmp_path, layout):
    """BOS / EOS / PAD and the template's token strings as transformers reads the same files:
    ids from config.json alone still name their strings; special_tokens_map.json names them;
    an explicit "bos_token": null in tokenizer_config.json (Qwen2.5) means no BOS although
    config.json has a bos_token_id."""
    from transformers import AutoTokenizer

    _train_tokenizer(tmp_path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if layout == "ids_in_config_only":
        (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    elif layout == "special_tokens_map":
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}))
    else:
        (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        config.update(bos_token=None, eos_token="</s>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = HFTokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    if layout == "bos_null":
        assert ours.bos_id is None and hf.bos_token_id is None and ours.encode("a cat", add_bos=True) == hf.encode(
            "a cat", add_special_tokens=False)
    if layout == "special_tokens_map":
        assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    if layout == "ids_in_config_only":
        assert (ours.bos_id, ours.eos_id) == (1, 2)
    want = {k: v for k, v in (("bos_token", "<s>"), ("eos_token", "</s>")) if layout != "bos_null" or k != "bos_token"}
    assert {k: ours.special_tokens.get(k) for k in want} == want
    assert "bos_token" not in ours.special_tokens or layout != "bos_null"


def test_a_missing_bos_or_pad_stays_missing_through_a_save(tmp_path):
    """Qwen2.5's layout: ``"bos_token": null`` and no PAD in tokenizer_config.json beside a
    config.json that lists both ids. A save writes the nulls, so the copy still has no BOS
    when a config.json with ids sits next to it (before, the null was dropped and
    config.json's BOS came back), PAD still falls back to EOS, and transformers reads the
    same specials from both directories; a PAD assigned after loading is saved."""
    from transformers import AutoTokenizer

    _train_tokenizer(tmp_path)
    ids = json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    (tmp_path / "config.json").write_text(ids)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "pad_token": None, "eos_token": "</s>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.pad_named) == (None, 2, 2, False)
    (tmp_path / "again").mkdir()
    save_tokenizer(tok, tmp_path / "again")
    (tmp_path / "again" / "config.json").write_text(ids)
    again = HFTokenizer.from_dir(tmp_path / "again")
    assert (again.bos_id, again.eos_id, again.pad_id, again.pad_named) == (None, 2, 2, False)
    hf, hf_again = (AutoTokenizer.from_pretrained(str(p)) for p in (tmp_path, tmp_path / "again"))
    assert (hf_again.bos_token_id, hf_again.eos_token_id, hf_again.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (None, 2, None)
    tok.pad_id = 0
    (tmp_path / "third").mkdir()
    save_tokenizer(tok, tmp_path / "third")
    assert HFTokenizer.from_dir(tmp_path / "third").pad_id == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "third")).pad_token_id == 0


def test_a_tokenizer_is_saved_as_it_was_read_even_after_its_files_change(tmp_path):
    """Saving copied the source directory's files as they were at save time: a source
    overwritten (or deleted) since loading gave another tokenizer or lost its settings."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    _train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 777, "eos_token": "</s>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    want = tok.encode("the cat sat")
    other = Tokenizer(models.WordLevel({"<unk>": 0, "the": 1}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(tmp_path / "tokenizer.json"))  # the source directory now holds another tokenizer
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "again").mkdir()
    save_tokenizer(tok, tmp_path / "again")
    again = HFTokenizer.from_dir(tmp_path / "again")
    assert again.encode("the cat sat") == want
    config = json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 777 and config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_named_chat_templates_survive_a_save(tmp_path):
    """A ``tool_use`` template beside the default one (the old list form in
    tokenizer_config.json): transformers renders it from the saved copy (it was dropped)."""
    from transformers import AutoTokenizer

    _train_tokenizer(tmp_path)
    templates = [{"name": "default", "template": "D:{% for m in messages %}{{ m.content }}{% endfor %}"},
                 {"name": "tool_use", "template": "T:{% for m in messages %}{{ m.content }}{% endfor %}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "chat_template": templates}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.named_chat_templates == {"tool_use": templates[1]["template"]}
    (tmp_path / "again").mkdir()
    save_tokenizer(tok, tmp_path / "again")
    msgs = [{"role": "user", "content": "hi"}]
    for where in (tmp_path, tmp_path / "again"):
        hf = AutoTokenizer.from_pretrained(str(where))
        assert hf.apply_chat_template(msgs, chat_template="tool_use", tokenize=False) == "T:hi"
        assert hf.apply_chat_template(msgs, tokenize=False) == "D:hi"
    assert HFTokenizer.from_dir(tmp_path / "again").named_chat_templates == tok.named_chat_templates
