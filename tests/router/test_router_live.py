"""A real uvicorn server on 127.0.0.1 with a FakeBackend: the official openai client, and disconnects."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from testkit.backend import FakeBackend

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_openai_client_chat_and_completions(live_server, tokenizer):
    backend = FakeBackend(tokenizer)
    with live_server(backend) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
        assert [m.id for m in client.models.list().data] == [MODEL]

        chat = client.chat.completions.create(model=MODEL, messages=USER, temperature=0)
        assert chat.choices[0].message.content == tokenizer.decode(backend.reply_ids)
        assert chat.choices[0].finish_reason == "stop" and chat.object == "chat.completion"
        assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(USER))
        assert chat.usage.prompt_tokens_details.cached_tokens == 0

        stream = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])
        text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
        assert text == tokenizer.decode(backend.reply_ids[:5])
        assert chunks[-2].choices[0].finish_reason == "length"

        comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=100, logprobs=1)
        assert comp.choices[0].text == chat.choices[0].message.content and comp.object == "text_completion"
        assert comp.choices[0].logprobs.tokens and comp.usage.total_tokens > comp.usage.prompt_tokens
        streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=100, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text

        chunks = list(
            client.completions.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 4
        assert chunks[-2].choices[0].finish_reason == "length"

        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, stream=True))
        assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"

        # errors come through as the client's typed exceptions
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=USER, temperature=5000)
        assert info.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=USER)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=USER, n=17)
        assert info.value.body["param"] == "n"


def test_streaming_disconnect_aborts(live_server, tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.05)
    with live_server(backend) as url:
        with httpx.Client(base_url=url, timeout=10) as http:
            with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": USER, "stream": True, "max_tokens": 200, "ignore_eos": True},
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert got[0].startswith("data: ")
            # leaving the block closes the connection mid-stream
        assert wait_for(lambda: len(backend.aborted) == 1), "abort was not called"
        assert backend.aborted[0] == backend.requests[0].request_id
        assert backend.finished == []
        assert wait_for(lambda: backend.active == {})  # the generator was closed too


def test_non_streaming_disconnect_aborts(live_server, tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.05)
    with live_server(backend) as url:
        with httpx.Client(base_url=url, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        assert wait_for(lambda: len(backend.aborted) == 1), "abort was not called"
        assert backend.finished == []


def test_streaming_disconnect_before_first_token_aborts(live_server, tokenizer):
    backend = FakeBackend(tokenizer, first_token_delay=5.0)
    with live_server(backend) as url:
        with httpx.Client(base_url=url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json={"messages": USER, "stream": True})
        assert wait_for(lambda: len(backend.aborted) == 1), "abort was not called"


def test_finished_requests_are_not_aborted(live_server, tokenizer):
    backend = FakeBackend(tokenizer)
    with live_server(backend) as url:
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/v1/chat/completions", json={"messages": USER, "stream": True}).status_code == 200
            assert http.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
    assert len(backend.finished) == 2 and backend.aborted == []
