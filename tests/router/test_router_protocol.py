"""Request schemas and their conversion to SamplingParams."""

from __future__ import annotations

import pytest

from router.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_extras,
    check_common,
    to_sampling_params,
)
from router.serving import parse

# model_construct skips validation and defaults: what to_sampling_params reads besides the field under test.
COMPLETION_DEFAULTS = {
    name: f.default for name, f in CompletionRequest.model_fields.items() if name not in ("prompt", "logprobs")
}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_defaults_and_conversion():
    sp = to_sampling_params(chat(), 100)
    assert sp.max_tokens == 100 and sp.temperature == 1.0 and sp.top_p == 1.0 and sp.logprobs is None
    sp = to_sampling_params(
        chat(
            temperature=0,
            top_p=0.5,
            top_k=5,
            min_p=0.1,
            seed=7,
            stop="END",
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
            min_tokens=2,
            stop_token_ids=[5],
            logprobs=True,
            top_logprobs=3,
        ),
        10,
    )
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.0, 0.5, 5, 0.1, 7)
    assert sp.stop == ["END"] and sp.stop_token_ids == [5] and sp.ignore_eos and sp.min_tokens == 2
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logprobs) == (0.5, -0.5, 1.2, 3)
    assert to_sampling_params(chat(logprobs=True), 10).logprobs == 0
    comp = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2, "stop": ["a", "b"]})
    sp = to_sampling_params(comp, 5)
    assert sp.logprobs == 2 and sp.stop == ["a", "b"]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": 101}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 50}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(kw, param):
    # The schema refuses what it can range-check; SamplingParams what depends on other fields.
    with pytest.raises(APIError) as info:
        to_sampling_params(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **kw}), 10)
    assert info.value.status == 400 and info.value.param.startswith(param) and param in info.value.message


def test_renamed_fields_keep_the_request_name():
    with pytest.raises(APIError) as info:
        to_sampling_params(CompletionRequest.model_construct(prompt="x", logprobs=50, **COMPLETION_DEFAULTS), 10)
    assert info.value.param == "logprobs"
    with pytest.raises(APIError) as info:
        parse(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        )
    assert info.value.param == "top_logprobs"
    with pytest.raises(APIError) as info:
        check_chat_extras(chat(top_logprobs=2))
    assert info.value.param == "top_logprobs"


def test_common_checks():
    with pytest.raises(APIError) as info:
        check_common(chat(stream_options={"include_usage": True}))
    assert info.value.param == "stream_options"
    with pytest.raises(APIError) as info:
        check_common(
            ChatCompletionRequest.model_construct(
                messages=[], n=1, stream=False, stream_options=None, max_tokens=None, max_completion_tokens=0
            )
        )
    assert info.value.param == "max_completion_tokens"
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == (7, "max_completion_tokens")


def test_content_parts_are_joined_and_other_parts_rejected():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.template_messages() == [{"role": "user", "content": "a\nb"}]
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError) as info:
        req.template_messages()
    assert info.value.param == "messages[0].content[0]"


def test_chunk_model_accepts_usage_chunk():
    chunk = ChatCompletionChunk.model_validate(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": 2,
                "total_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )
    assert chunk.usage.total_tokens == 3
