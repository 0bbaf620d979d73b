"""The user-facing API: `LLM(model, **config).generate(prompts, params)` and streaming.

    llm = LLM("path/to/checkpoint", max_num_seqs=64)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(delta.new_text, end="")
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))  # chat template

Keyword arguments are EngineConfig fields; an unknown one is refused by name.

Threads may share an LLM: its calls take the engine's lock (LLMEngine), so they run one at a time;
generate() holds it for its whole run, stream() for each of its steps.
"""

import numbers
import os
from collections.abc import Iterator, Mapping, Sequence

from pcg_engine.config import EngineConfig
from pcg_engine.engine.llm_engine import LLMEngine
from pcg_engine.errors import EngineClosedError, InvalidRequestError
from pcg_engine.outputs import RequestOutput, abandoned
from pcg_engine.sampling_params import SamplingParams


def _in_conversation(error: InvalidRequestError, i: int, n: int) -> InvalidRequestError:
    """LLM.chat's error for its conversation i of n (the error itself where there is one)."""
    if n == 1:
        return error
    labelled = InvalidRequestError(error.field, f"conversation {i} of {n}: {error.message}")
    labelled.prompt_index = i
    return labelled


class LLM:
    def __init__(self, model: str | None = None, progress=None, **config):
        # A path object as its string; anything else reaches EngineConfig's check as given (str()
        # made LLM(123) look for a directory "123", and bytes one named "b'/path'").
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.engine = LLMEngine(self.config, progress=progress)

    @property
    def tokenizer(self):
        """The checkpoint's (transformers) tokenizer, loaded on first use."""
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output=None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Every prompt is validated before any is queued, so one bad prompt raises (naming its
        field and, among several, which prompt) without running the others half-way. If the call
        is stopped by an exception (the callback raising, Ctrl-C), the requests it queued are
        aborted: the next call does not run them. Requests that others added to the engine keep
        running meanwhile; their outputs are not this call's (on_output does not see them) and stay
        with the engine: its next step() returns them first."""
        # One prompt: text, or token ids, which add_request also takes as numpy integers or a 1-D
        # array or tensor (those were read as a list of prompts, or refused as 'got ndarray').
        # A 1-D numpy array of text (or objects) is a list of prompts: taken as one, it was refused
        # as "a list of N strings; ... LLM.generate takes a list of prompts".
        if getattr(prompts, "ndim", None) == 1 and getattr(getattr(prompts, "dtype", None), "kind", None) in ("U", "S", "O"):
            prompts = prompts.tolist()
        if (isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1
                or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral))):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts", "must be a string, a list of token ids, or a list of those; "
                                                 f"got {type(prompts).__name__}")
        params = self._params_list(sampling_params, len(prompts))
        if on_output is not None and not callable(on_output):
            # Before any request is queued: called only once a step has run, it raised a bare TypeError.
            raise InvalidRequestError("on_output", f"must be a callable taking a RequestOutput, or None; "
                                      f"got {type(on_output).__name__}")
        # The engine's lock for the whole run: another thread's generate, stream step or engine
        # call waits for it to end (this thread's on_output callback may use the engine). Taken
        # per step only, two generate() calls each parked the other's final outputs in `others`
        # until its own end, and both could end on "taken by another caller".
        with self.engine.lock:
            return self._generate(prompts, params, on_output)

    def _generate(self, prompts, params, on_output) -> list[RequestOutput]:
        ids = []
        finals: dict[str, RequestOutput] = {}
        others: list[RequestOutput] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                # Without a callback only the final outputs are used: skip the per-step ones.
                try:
                    ids.append(self.engine.add_request(prompt, p, final_only=on_output is None))
                except InvalidRequestError as e:
                    error = e
                    if len(prompts) > 1:     # which of the prompts: the field alone does not say
                        error = InvalidRequestError(e.field, f"{e.message} (prompt {i} of {len(prompts)}; "
                                                    "none of them was run)")
                    error.prompt_index = i
                    raise error from None
            mine = set(ids)
            while len(finals) < len(ids):
                outputs = []
                # The other requests' outputs (requests added to the engine by someone else, the
                # callback included) are set aside however this call's are left: when the callback
                # raised, those behind its output in the step were lost, a final one with them,
                # and whoever waited for it never got it; and so were all of them when Ctrl-C fell
                # right after the step returned (found by a review).
                try:
                    outputs = self.engine.step()
                    for out in outputs:
                        if out.request_id not in mine:
                            continue
                        if on_output is not None:
                            on_output(out)
                        if out.finished:
                            finals[out.request_id] = out
                finally:
                    others += [out for out in outputs if out.request_id not in mine]
                if (len(finals) < len(ids) and not self.engine.has_unfinished_requests()
                        and not self.engine.closed):    # closed: the next step() says so
                    # Nothing left can bring the missing final outputs: someone else's
                    # engine.step() (the callback's, most often) took them. Stepping on would spin
                    # on an idle engine forever.
                    lost = [rid for rid in ids if rid not in finals]
                    raise RuntimeError(f"generate: request {lost[0]!r} finished, but its final output was taken "
                                       f"by another caller of engine.step() ({len(lost)} of this call's "
                                       f"{len(ids)} requests lost so)")
        except BaseException:
            # Not those that finished: their ids are free again, and a request added under one
            # since (by the callback) is not this call's to abort.
            self._abandon([rid for rid in ids if rid not in finals])
            raise
        finally:
            # Other requests' outputs stay with the engine: its next step() returns them first.
            self._hand_back(others)
        return [finals[rid] for rid in ids]

    def _abandon(self, ids) -> None:
        """Abort those of ids still in the engine and drop their outputs (LLMEngine.abandon). A
        request whose step is in flight frees its blocks at once; the step's token is dropped when
        it is resolved. Errors here are not raised over the exception that stopped generate()."""
        self.engine.abandon(list(ids))

    def _hand_back(self, others) -> None:
        """Other callers' outputs back to the engine: its next step() returns them first. Not
        those of requests abandoned meanwhile (a stream collected during this call's step): nobody
        would take them, and they went round between callers for ever."""
        self.engine.pending_outputs[:0] = [out for out in others if not abandoned(out)]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             on_output=None, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list | None = None) -> list[RequestOutput]:
        """generate() for conversations: `messages` is one conversation (a list of {"role": ...,
        "content": ...} dicts) or a list of them, each rendered with the checkpoint's chat template
        (pcg_engine/chat.py; chat_template_kwargs such as {"enable_thinking": False} and tools go to
        the template). Outputs in conversation order; each output's prompt is its template text.
        Every conversation is rendered and checked before any runs: a bad one raises
        InvalidRequestError naming which conversation among several, and runs none."""
        from pcg_engine import chat
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError("add_generation_prompt", f"must be true or false, got {add_generation_prompt!r}")
        if chat_template_kwargs is not None and not (isinstance(chat_template_kwargs, Mapping)
                                                     and all(isinstance(k, str) for k in chat_template_kwargs)):
            raise InvalidRequestError("chat_template_kwargs", f"must be a dict of the template's variables by name, "
                                      f"or None; got {chat_template_kwargs!r:.80}")
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
            raise InvalidRequestError("tools", f"must be a list of tool descriptions, or None; got {type(tools).__name__}")
        # Several conversations when the first item is itself a list of messages; else one (whose
        # bad message, None or a string among them, is then named by its index).
        first = messages[0] if isinstance(messages, Sequence) and messages else None
        several = isinstance(first, Sequence) and not isinstance(first, (str, bytes))
        conversations = messages if several else [messages]
        n = len(conversations)
        # Under the engine's lock (re-entrant: generate takes it again): the tokenizer, loaded on
        # first use, is loaded once when two threads chat at once.
        with self.engine.lock:
            texts = []
            for i, conversation in enumerate(conversations):
                try:
                    texts.append(chat.render(self.engine, conversation, add_generation_prompt, tools,
                                             chat_template_kwargs))
                except InvalidRequestError as e:
                    raise _in_conversation(e, i, n) from None
            try:
                return self.generate(texts, sampling_params, on_output)
            except InvalidRequestError as e:
                # the template's text refused (too long for max_model_len): which conversation's
                if e.prompt_index is None:
                    raise
                raise _in_conversation(e, e.prompt_index, n) from None

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per step that brought this request new tokens, the last one finished.

        Other requests added to the engine meanwhile keep running alongside. Each step holds the
        engine's lock (not while the caller has the output: another thread's calls run then).

        The request is checked and added here, before the first output is asked for: a bad one
        raises InvalidRequestError from this call (a server can refuse it before it starts its
        response; as a generator function, it raised only at the first next()). Closing or
        dropping the stream before its end aborts the request."""
        outputs = self._stream(self.engine.add_request(prompt, sampling_params))
        next(outputs)            # to the generator's first yield, inside its try: see _stream
        return outputs

    def _stream(self, rid: str) -> Iterator[RequestOutput]:
        done = False
        request = self.engine.requests[rid]
        try:
            # stream() runs to here: from now on closing the generator (or its collection) runs the
            # finally below, also before the caller asked for anything.
            yield None
            while True:
                with self.engine.lock:
                    outputs = []
                    # Other requests' outputs go back to the engine now, before yielding, not when
                    # this stream ends: while it is suspended, whoever steps next (another stream,
                    # most often) must get them. Kept here until the end, a stream iterated
                    # alternately with another lost the other's deltas, and when the other
                    # request's final output was among them, the other stream stepped an idle
                    # engine forever. Handed back however this stream is left (Ctrl-C here lost them).
                    try:
                        outputs = self.engine.step()
                        mine = [out for out in outputs if out.request_id == rid]
                    finally:
                        self._hand_back([out for out in outputs if out.request_id != rid])
                for out in mine:
                    done = out.finished
                    yield out
                    if done:
                        return
                with self.engine.lock:
                    if self.engine.closed:   # close() dropped its request: not someone else's step()
                        raise EngineClosedError("stream")
                    if rid not in self.engine.requests and all(o.request_id != rid
                                                               for o in self.engine.pending_outputs):
                        # Finished, but its final output went to someone else's engine.step(): no
                        # step will ever bring it here.
                        raise RuntimeError(f"request {rid!r} of this stream finished, but its final output "
                                           "was taken by another caller of engine.step()")
        finally:
            # The caller stopped early: don't leak its blocks, nor leave its abort output behind.
            # Not once its final output is out: the id is free again, and a request that the
            # caller has added under it since is not this stream's to abort.
            if not done:
                # Flagged also when it has finished: its last outputs may be in another caller's
                # hands (its step brought them), handed back to the engine later and taken by
                # nobody: has_unfinished_requests() stayed True for good (found by a review).
                request.abandoned = True
                if self.engine.requests.get(rid) in (request, None):   # (not a new request's, under its id)
                    self._abandon([rid])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, so the next prompt is computed in full; False (and
        nothing changed) while a request is unfinished (LLMEngine.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the engine's GPU memory now rather than whenever the garbage collector runs;
        the next LLM built in this process then sizes its KV cache from a free GPU."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _params_list(params, n):
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, (SamplingParams, dict)):
            return [params] * n
        allowed = "a SamplingParams, a dict of its fields, or a list of those (one per prompt)"
        if not isinstance(params, Sequence) or isinstance(params, str):
            raise InvalidRequestError("sampling_params", f"must be {allowed}; got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise InvalidRequestError("sampling_params", f"{len(params)} given for {n} prompts; give one or {n}")
        for i, p in enumerate(params):
            if p is not None and not isinstance(p, (SamplingParams, dict)):
                raise InvalidRequestError("sampling_params", f"must be {allowed}; item {i} is a {type(p).__name__}")
        return params
