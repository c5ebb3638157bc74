"""Does the compiled decode step trace through the FP8 weights and the fp8 cache on CPU?"""
import time
import torch
import torch._dynamo
from actors.generation.decoding import GenerationConfig
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from tests.actors.generation.test_generate import BASE, build_hf, ours_from_hf, random_prompts

torch.set_num_threads(2)
model = ours_from_hf(build_hf("Llama", tie_word_embeddings=True))
prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6])
for opts in ({"fp8_weights": True}, {"kv_cache_dtype": "fp8"}, {"fp8_weights": True, "kv_cache_dtype": "fp8"}):
    base = {"max_new_tokens": 6, "sampling": SamplingParams(temperature=0.0), "seed": 3}
    t = time.time()
    eager = generate(model, prompts, GenerationConfig(**base, **opts))
    torch._dynamo.reset()
    counts = {}
    from torch._dynamo.utils import counters
    counters.clear()
    comp = generate(model, prompts, GenerationConfig(**base, **opts, compile_decode=True))
    breaks = dict(counters["graph_break"])
    print(opts, "tokens equal:", torch.equal(eager.tokens, comp.tokens) if hasattr(eager, "tokens") else None,
          "max logprob diff:", (eager.logprobs - comp.logprobs).abs().max().item(), "graph breaks:", breaks,
          f"{time.time() - t:.1f}s", flush=True)
