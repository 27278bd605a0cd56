"""Predicted Outputs and ``--speculative`` over HTTP, through the official OpenAI SDK on a
real server: the same completion with and without drafts, usage counting the prediction
tokens, the Prometheus counters, the acceptance rate on the model card, and a refusal
naming ``prediction`` where the engine takes no drafts."""

from __future__ import annotations

import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, running

GEMMA4 = TINY_MODEL.parent / "tiny-gemma4"  # repeats itself: the prompt lookup finds its own output
MESSAGES = [{"role": "user", "content": "Write the same word many times."}]


def test_predicted_outputs_and_prompt_lookup_over_http() -> None:
    config = ServerConfig(
        models={"plain": GEMMA4, "ngram": GEMMA4, "og": GEMMA4},
        model_configs={
            "ngram": ModelConfig(speculative="ngram"),
            "og": ModelConfig(engine="og-generator"),
        },
    )
    with running(create_app(config)) as base:
        client = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0))
        options = {"max_tokens": 48, "temperature": 0, "logprobs": True}
        want = client.chat.completions.create(model="plain", messages=MESSAGES, **options)  # type: ignore[call-overload]
        text = want.choices[0].message.content
        assert text and want.usage is not None and want.usage.completion_tokens_details is None

        predicted = client.chat.completions.create(
            model="plain",
            messages=MESSAGES,
            prediction={"type": "content", "content": text},
            **options,
        )
        assert predicted.choices[0].message.content == text
        assert [t.logprob for t in predicted.choices[0].logprobs.content] == pytest.approx(
            [t.logprob for t in want.choices[0].logprobs.content], abs=1e-4
        )
        details = predicted.usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens >= 20
        assert details.rejected_prediction_tokens is not None

        # The prediction as text parts, streamed, and on text completions too.
        stream = client.chat.completions.create(
            model="plain",
            messages=MESSAGES,
            prediction={"type": "content", "content": [{"type": "text", "text": text}]},
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=48,
            temperature=0,
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 20
        plain_completion = client.completions.create(model="plain", prompt="same same", max_tokens=32, temperature=0)
        predicted_completion = client.completions.create(
            model="plain",
            prompt="same same",
            max_tokens=32,
            temperature=0,
            extra_body={"prediction": {"type": "content", "content": plain_completion.choices[0].text}},
        )
        assert predicted_completion.choices[0].text == plain_completion.choices[0].text
        assert predicted_completion.usage.completion_tokens_details.accepted_prediction_tokens > 0

        # --speculative ngram: the same text; the model card shows the acceptance.
        looked_up = client.chat.completions.create(model="ngram", messages=MESSAGES, **options)
        assert looked_up.choices[0].message.content == text
        assert looked_up.usage.completion_tokens_details.accepted_prediction_tokens >= 20
        card = httpx.get(f"{base}/v1/models/ngram").json()
        assert card["speculative"] == "ngram" and card["reproducible"] is False
        assert card["draft_tokens"] > 0 and 0 < card["draft_acceptance_rate"] <= 1
        assert httpx.get(f"{base}/v1/models/plain").json()["speculative"] is None
        metrics = httpx.get(f"{base}/metrics").text
        assert 'ortserve_spec_accepted_tokens_total{model="ngram"}' in metrics
        assert 'ortserve_spec_proposed_tokens_total{model="plain"}' in metrics

        # A prediction none of which is taken still reports both counts, as OpenAI does.
        for prediction in ("Quantum zebra xylophone", ""):
            missed = client.chat.completions.create(
                model="plain",
                messages=MESSAGES,
                max_tokens=8,
                temperature=0,
                prediction={"type": "content", "content": prediction},
            )
            assert missed.usage is not None and missed.usage.completion_tokens_details is not None
            assert missed.usage.completion_tokens_details.accepted_prediction_tokens == 0
            assert missed.usage.completion_tokens_details.rejected_prediction_tokens is not None

        # An engine that takes no drafts refuses a prediction by name; the server serves on.
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="og", messages=MESSAGES, max_tokens=4, prediction={"type": "content", "content": "same"}
            )
        assert refused.value.body["param"] == "prediction"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as malformed:
            client.chat.completions.create(
                model="plain",
                messages=MESSAGES,
                max_tokens=4,
                prediction={"type": "text", "content": "same"},  # type: ignore[typeddict-item]
            )
        assert "prediction" in str(malformed.value)
        again = client.chat.completions.create(model="plain", messages=MESSAGES, **options)
        assert again.choices[0].message.content == text
