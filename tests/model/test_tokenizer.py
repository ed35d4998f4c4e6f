"""Tokenizer contract on a hand-built 9-token byte-level vocabulary."""

import jinja2
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from shared.model.tokenizer import Tokenizer

VOCAB = {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "h": 3, "i": 4, "Ġ": 5, "hi": 6, "Ġhi": 7, "!": 8}


def make(chat_template=None, eos="</s>", extra=()):
    backend = tokenizers.Tokenizer(models.BPE(vocab=VOCAB, merges=[("h", "i"), ("Ġ", "hi")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<|im_end|>")])
    return Tokenizer(backend, chat_template, "<s>", eos, extra)


def test_encode_decode():
    tok = make()
    assert tok.encode("hi hi!") == [6, 7, 8]
    assert tok.encode("<s>hi</s>") == [0, 6, 1]
    assert tok.decode([0, 6, 7, 1]) == "hi hi" and tok.decode([0, 6, 1], skip_special_tokens=False) == "<s>hi</s>"
    assert (tok.bos_token_id, tok.vocab_size) == (0, 9)


def test_eos_ids_add_end_of_turn_only_for_chat_models():
    assert make().eos_token_ids == {1}
    assert make(extra=[8]).eos_token_ids == {1, 8}
    assert make(chat_template="{{ messages[0]['content'] }}").eos_token_ids == {1, 2}
    assert make(eos=None).eos_token_ids == frozenset()


def test_render_chat_hf_semantics():
    template = ("{{ bos_token }}{% for m in messages %}\n    {% if m %}{{ m['role'] }}:{{ m['content'] | tojson }}"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}")
    tok = make(chat_template=template)
    messages = [{"role": "user", "content": "hi <b>"}]
    assert tok.render_chat(messages) == '<s>user:"hi <b>"bot:'  # trim_blocks + lstrip_blocks, no HTML escaping
    assert tok.render_chat(messages, add_generation_prompt=False) == '<s>user:"hi <b>"'
    assert tok.encode_chat([{"role": "u", "content": "hi"}], add_generation_prompt=False)[0] == 0  # one BOS, from the template


def test_render_chat_errors():
    with pytest.raises(ValueError, match="no chat template"):
        make().render_chat([{"role": "user", "content": "hi"}])
    tok = make(chat_template="{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        tok.render_chat([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        tok.render_chat([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\]: expected a mapping"):
        tok.render_chat(["hi"])
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        tok.render_chat([{"role": "user", "content": "a"}] * 2)


def test_template_is_sandboxed():
    tok = make(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.render_chat([])


def test_a_byte_level_vocabulary_gives_each_token_s_bytes():
    tok = make()
    assert tok.token_bytes == (b"", b"", b"", b"h", b"i", b" ", b"hi", b" hi", b"!")  # special tokens read nothing


def test_other_vocabularies_have_no_byte_table():
    tok = make()
    tok.backend.decoder = decoders.Metaspace()  # its decode is not the tokens' bytes joined
    assert Tokenizer(tok.backend, None, "<s>", "</s>").token_bytes is None
    tok = make()
    tok.backend.add_tokens([AddedToken("robot", special=False)])  # an added token that is text
    assert Tokenizer(tok.backend, None, "<s>", "</s>").token_bytes is None
