"""The serving warm-up's instruments (qjax/serving/warmup.py): the compile-time split of a program's first call, and
the memory-mapping budget that stops a warm-up before XLA:CPU runs out of regions."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest

from qjax.serving.warmup import MapBudget, compile_times, mapped_regions


def test_compile_times_split_a_first_call_into_its_stages():
    """compile_times: the trace, lowering and XLA compile of this thread's first call are counted; a second call of
    the same program adds nothing; another thread's compile is not counted."""
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    x = jnp.arange(7.0)
    with compile_times() as parts:
        f(x).block_until_ready()
    assert {"trace", "lower", "compile"} <= set(parts) and all(v > 0 for v in parts.values()), parts
    with compile_times() as again:
        f(x).block_until_ready()
        t = threading.Thread(target=lambda: jax.jit(lambda y: y - 2)(x).block_until_ready())
        t.start()
        t.join()
    assert again == {}, again



def test_the_map_budget_stops_before_the_limit_with_one_line():
    """Each program's regions are recorded; before the next one, twice the largest so far past the limit is refused
    with one line naming the limit and the flags; within it nothing happens; without /proc nothing is checked."""
    counts = iter([1_000, 21_000, 21_000, 21_000, 41_000, 41_000])  # enter, exit, check, enter, exit, check
    budget = MapBudget(lambda: (next(counts), 65_530))
    with budget:  # 1,000 → 21,000
        pass
    assert budget.most == 20_000
    budget.check("program 2", ValueError)  # 21,000 + 40,000 ≤ 65,530
    with budget:  # 21,000 → 41,000
        pass
    with pytest.raises(ValueError, match=r"program 3: this process maps 41,000 memory regions of the 65,530 .*"
                                         r"vm.max_map_count.* up to 20,000 .*--max-num-seqs") as e:
        budget.check("program 3", ValueError)
    assert "\n" not in str(e.value)
    off = MapBudget(lambda: None)
    with off:
        pass
    off.check("anything", ValueError)
    now = mapped_regions()
    assert now is None or (now[0] > 0 and now[1] > 0)
