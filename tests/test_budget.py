"""Budgets (``--max-tokens-total``, ``--budget-usd`` with ``--model-prices``): prices and costs,
the refusals, and a job stopped at its budget with nothing lost, by real workers and the consumer
against the stand-in servers on loopback (broker/job_budgets.py, consumer/budget_watch.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from broker.audit import JobAudit
from broker.job_budgets import JobBudget, ModelPrice, parse_model_prices, read_usage
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import StepRecord
from broker.settings import Settings, SettingsError
from broker.states import LEDGER_FINAL, LedgerState, StoredStatus
from consumer.budget_watch import BudgetWatch
from consumer.storage import open_store
from producer.enqueue import plan, submit
from tests.conftest import ROOT
from tests.storecheck import assert_trajectories_sound
from tests.taskfiles import write_arith_tasks
from tests.test_cancel import write_long_tasks
from tests.test_cli_redis import clean_env
from tests.test_recovery import cli
from tests.test_retry_honesty import job_page


# --- prices, costs and refusals ----------------------------------------------------------------
@pytest.mark.unit
def test_prices_parse_and_costs_are_per_million_tokens():
    prices = parse_model_prices(" gpt-4o-mini=0.15/0.60, meta-llama/Llama-3-8B=1/4 ,a=b=2/3")
    assert prices == {"gpt-4o-mini": ModelPrice(0.15, 0.60), "meta-llama/Llama-3-8B": ModelPrice(1, 4),
                      "a=b": ModelPrice(2, 3)}
    assert math.isclose(prices["gpt-4o-mini"].cost(1_000_000, 500_000), 0.15 + 0.30)
    assert math.isclose(prices["meta-llama/Llama-3-8B"].cost(1234, 567), (1234 * 1 + 567 * 4) / 1e6)
    assert parse_model_prices("") == {}
    b = JobBudget(max_tokens_total=1000, budget_usd=0.5, price=ModelPrice(100, 400))
    assert b.reached(999, 0.1) == ""
    assert b.reached(1000, 0.1) == "token budget reached (1,000 of 1,000 tokens)"
    assert b.reached(10, 0.5).startswith("cost budget reached ($0.5000 of $0.50)")
    # a USD budget without a price is none (the submit refuses it; a stored spec may lack one)
    assert not JobBudget(budget_usd=1.0).any and JobBudget(budget_usd=1.0).reached(10**9, 10**9) == ""


@pytest.mark.unit
@pytest.mark.parametrize("given, said", [
    ({"model_prices": "gpt=0.15"}, "model_prices entry 'gpt=0.15': expected MODEL=INPUT/OUTPUT"),
    ({"model_prices": "gpt=cheap/0.6"}, "model_prices entry 'gpt=cheap/0.6'"),
    ({"model_prices": "=1/2"}, "model_prices entry '=1/2'"),
    ({"model_prices": "gpt=-1/2"}, "prices must be finite and >= 0"),
    ({"model_prices": "gpt=1/2,gpt=3/4"}, "names 'gpt' twice"),
    ({"max_tokens_total": -1}, "max_tokens_total must be >= 0"),
    ({"budget_usd": -0.5}, "budget_usd must be a number >= 0"),
    ({"budget_usd": float("inf")}, "budget_usd must be a number >= 0"),
])
def test_bad_budgets_are_refused_naming_the_problem(given, said):
    with pytest.raises(SettingsError, match="invalid settings") as exc:
        Settings.from_env({}, **given)
    assert said in str(exc.value)


@pytest.mark.unit
def test_a_usd_budget_for_a_model_without_a_price_is_refused_at_submit(tmp_path):
    tasks = write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=2, env_num=1)
    for prices in ("", "other=1/4"):
        s = Settings.from_env({}, model="my-model", budget_usd=2.0, model_prices=prices)
        with pytest.raises(SettingsError) as exc:
            plan(s, [tasks])
        assert "--budget-usd 2 needs the price of the job's model 'my-model'" in str(exc.value)
        assert "--model-prices 'my-model=INPUT/OUTPUT'" in str(exc.value)
    priced = Settings.from_env({}, model="my-model", budget_usd=2.0, model_prices="other=1/4,my-model=0.5/1.5")
    assert plan(priced, [tasks]).episodes


def test_the_command_line_refuses_bad_budgets_in_one_line(settings, tmp_path):
    tasks = write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=2, env_num=1)
    for args, said in ((["--model-prices", "stand-in:1/2"], "model_prices entry 'stand-in:1/2'"),
                       (["--budget-usd", "1"], "needs the price of the job's model 'stand-in'"),
                       (["--max-tokens-total", "-3"], "max_tokens_total must be >= 0")):
        out = cli(settings, "submit", tasks, "--no-preflight", *args)
        assert out.returncode == 2 and said in out.stderr, out.stdout + out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


# --- the consumer's side, on the real Redis ----------------------------------------------------
def _step(job_id: str, n: int, prompt: int | None, completion: int | None, cached: bool = False) -> StepRecord:
    return StepRecord(job_id=job_id, env_id=f"e{n}", attempt=1, step_id=1, env_name="arithmetic",
                      llm_model="stand-in", group_id="g", messages_json=b"[]", response="", step_reward=0.0,
                      cumulative_reward=0.0, terminated=False, truncated=False, episode_finished=False,
                      is_trainable=True, prompt_tokens=prompt, completion_tokens=completion, cached=cached)


def test_a_usd_budget_stops_the_job_on_its_cost_once(settings, redis_client, tmp_path):
    """At $100/$400 per 1M tokens a budget of $0.50 is reached by 1,000 prompt + 1,000 completion
    tokens; the job is cancelled (its queued episodes at once), the stop said once in its usage
    and its audit log; cached steps and steps without usage are counted apart, never charged."""
    s = settings.replace(budget_usd=0.5, model_prices="stand-in=100/400")
    sub = submit(redis_client, s, [write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=3, env_num=2)])
    job = sub.job.job_id
    assert (sub.job.budget_usd, sub.job.price) == (0.5, [100.0, 400.0])
    keys, ledger = Keys(s.key_prefix), Ledger.for_settings(redis_client, s)
    watch = BudgetWatch(redis_client, s)

    watch([_step(job, 1, 400, 300), _step(job, 2, None, None), _step(job, 3, 5000, 5000, cached=True)])
    u = read_usage(redis_client, keys, job)
    assert (u.prompt_tokens, u.completion_tokens, u.unknown_steps, u.cached_steps) == (400, 300, 1, 1)
    assert math.isclose(u.cost_usd, (400 * 100 + 300 * 400) / 1e6) and u.stop == ""
    assert ledger.counts(job)[LedgerState.QUEUED] == 6

    watch([_step(job, 4, 600, 700)])  # 1,000 prompt tokens at $100 + 1,000 completion at $400 per 1M
    u = read_usage(redis_client, keys, job)
    assert math.isclose(u.cost_usd, 0.5) and u.stop == "cost budget reached ($0.5000 of $0.50)"
    assert ledger.counts(job)[LedgerState.CANCELLED] == 6
    watch([_step(job, 5, 10, 10)])  # late records still count; the job is stopped once
    assert read_usage(redis_client, keys, job).tokens == 2020
    stops = [e for e in JobAudit(redis_client, keys).entries(job) if e["action"] == "budget_stop"]
    assert len(stops) == 1 and stops[0]["who"] == "interactor (budget)"
    assert stops[0]["detail"]["why"] == u.stop and stops[0]["detail"]["budget_usd"] == 0.5
    # retention: the usage is one of the job's keys
    assert keys.job_usage(job) in keys.job_keys(job)


def test_a_job_without_budgets_is_counted_and_never_stopped(settings, redis_client, tmp_path):
    sub = submit(redis_client, settings, [write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=1, env_num=1)])
    watch = BudgetWatch(redis_client, settings)
    watch([_step(sub.job.job_id, 1, 10**9, 10**9)])
    u = read_usage(redis_client, Keys(settings.key_prefix), sub.job.job_id)
    assert u.tokens == 2 * 10**9 and u.cost_usd == 0 and u.stop == ""
    assert Ledger.for_settings(redis_client, settings).counts(sub.job.job_id)[LedgerState.QUEUED] == 1
    watch([_step("forgotten-job", 1, 5, 5)])  # a job Redis no longer has keeps no usage key
    assert not redis_client.exists(Keys(settings.key_prefix).job_usage("forgotten-job"))


def test_job_set_changes_the_budgets_the_consumer_enforces(settings, redis_client, tmp_path):
    """`interactor job JOB set --max-tokens-total N` on a job submitted without a budget: the
    consumer's next batch past it stops the job; a USD budget for a job whose model got no price at
    submit is refused naming --model-prices; 0 removes a budget."""
    from interactor.job_set import SetRefused, set_limits

    sub = submit(redis_client, settings, [write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=3, env_num=2)])
    job = sub.job.job_id
    keys, ledger = Keys(settings.key_prefix), Ledger.for_settings(redis_client, settings)
    watch = BudgetWatch(redis_client, settings)
    watch([_step(job, 1, 400, 300)])
    with pytest.raises(SetRefused, match="--model-prices"):
        set_limits(redis_client, settings, job, budget_usd=1.0, who="ops")
    said = set_limits(redis_client, settings, job, max_tokens_total=1000, who="ops")["said"]
    assert any("token budget: 1,000 tokens" in line for line in said)
    watch._budgets.clear()  # what SPEC_FRESH_S seconds do: the watch reads the job's budgets again
    watch([_step(job, 2, 200, 200)])  # 1,100 tokens in all: past the new budget
    u = read_usage(redis_client, keys, job)
    assert u.stop == "token budget reached (1,100 of 1,000 tokens)"
    assert ledger.counts(job)[LedgerState.CANCELLED] == 6
    entries = JobAudit(redis_client, keys).entries(job)
    assert [e["action"] for e in entries] == ["cancel", "budget_stop", "set"]
    assert entries[2]["who"] == "ops" and entries[2]["detail"] == {"max_tokens_total": 1000}

    (tmp_path / "b").mkdir()
    other = submit(redis_client, settings.replace(max_tokens_total=500),
                   [write_arith_tasks(tmp_path / "b", "http://127.0.0.1:9", rows=1, env_num=1)]).job.job_id
    set_limits(redis_client, settings, other, max_tokens_total=0)
    watch([_step(other, 1, 10**6, 10**6)])  # the submit's 500 no longer holds
    assert read_usage(redis_client, keys, other).stop == ""


# --- a real run stopped by its token budget ----------------------------------------------------
def test_a_token_budget_stops_a_run_with_nothing_lost(settings, redis_client, env_server, tmp_path):
    """20 episodes of about 20 turns, 4 at a time, on a model answering in 100 ms with usage;
    the budget is about six episodes' tokens. `interactor run` ends with exit 4 saying why; the
    completed episodes are stored with all their steps, the rest cancelled, none failed or
    dead-lettered; the tokens used reach the budget and pass it by less than what the running
    episodes make in the time a stop takes to reach them."""
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    model, model_url = start_in_thread(latency_ms=100)
    budget, concurrency, job = 12_000, 4, "budget-job"
    s = settings.replace(llm_base_url=model_url + "/v1")
    try:
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "interactor.cli", "run",
                              write_long_tasks(tmp_path, env_url, groups=5, size=4), "--concurrency",
                              str(concurrency), "--workers", "1", "--job-id", job, "--max-tokens-total", str(budget),
                              "--model-prices", "stand-in=2/8"],
                             env=clean_env() | s.as_environ(), cwd=str(ROOT), capture_output=True, text=True,
                             timeout=300)
        took = time.monotonic() - t0
    finally:
        model.shutdown()
    out = run.stdout
    assert run.returncode == 4, out[-3000:] + run.stderr[-3000:]
    assert "stopped: token budget reached (" in out and f"of {budget:,} tokens)" in out, out[-3000:]

    ledger, keys = Ledger.for_settings(redis_client, s), Keys(s.key_prefix)
    counts = ledger.counts(job)
    total = sum(counts[st] for st in LedgerState)
    assert total == 20 and sum(counts[st] for st in LEDGER_FINAL) == total, counts
    assert counts[LedgerState.FAILED] == 0 and counts[LedgerState.DONE] >= 1 and counts[LedgerState.CANCELLED] >= 1
    assert DeadLetterQueue(redis_client, s).list(job_id=job) == []
    usage = read_usage(redis_client, keys, job)
    stops = [e for e in JobAudit(redis_client, keys).entries(job) if e["action"] == "budget_stop"]
    assert len(stops) == 1 and stops[0]["detail"]["max_tokens_total"] == budget, stops

    store = open_store(s.results_store, readonly=True)
    try:
        res = store.results(job)
        assert res["job"][StoredStatus.COMPLETED] == counts[LedgerState.DONE]
        assert res["job"][StoredStatus.CANCELLED] == counts[LedgerState.CANCELLED]
        assert res["job"][StoredStatus.FAILED] == 0 and store.failure_reasons(job) == []
        u = res["usage"]
        step_tokens = [p + c for p, c in store.sql(
            "SELECT prompt_tokens, completion_tokens FROM session_steps WHERE job_id = ? UNION ALL "
            "SELECT prompt_tokens, completion_tokens FROM superseded_steps WHERE job_id = ?", (job, job))]
    finally:
        store.close()
    assert_trajectories_sound(s.results_store, job)  # what completed: all its steps
    # Every call made is stored and counted once: the store's sum is Redis's.
    assert (u["prompt_tokens"], u["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert u["unknown_steps"] == 0 and u["cached_steps"] == 0
    assert math.isclose(u["cost_usd"], (u["prompt_tokens"] * 2 + u["completion_tokens"] * 8) / 1e6)
    assert u["budget_reached"] == f"token budget reached ({u['tokens']:,} of {budget:,} tokens)"
    # Overshoot: the stop reaches a running episode at its attempt's next lease renewal; each of
    # them makes at most a renewal interval's and the consumer's lag's worth of calls meanwhile.
    overshoot = u["tokens"] - budget
    largest = max(step_tokens)
    bound = concurrency * largest * 30
    print(f"budget {budget}, used {u['tokens']} (overshoot {overshoot} = {overshoot / budget:.1%}; "
          f"{len(step_tokens)} calls of at most {largest} tokens; bound {bound}); run took {took:.1f}s")
    assert 0 <= overshoot <= bound, (overshoot, bound)

    shown = cli(s, "results", job)
    assert shown.returncode == 0, shown.stderr
    assert f"token budget {budget:,}" in shown.stdout and "token budget reached" in shown.stdout, shown.stdout
    as_json = cli(s, "results", job, "--json")
    assert json.loads(as_json.stdout)["usage"]["tokens"] == u["tokens"], as_json.stdout[-2000:]
    # status, from Redis: the consumer's count (the same here) and the stop
    status = cli(s, "status", job)
    assert status.returncode == 0 and f"{job} (stopped: budget)" in status.stdout, status.stdout + status.stderr
    assert f"usage      {job}: {u['tokens']:,} tokens" in status.stdout, status.stdout
    assert f"of {budget:,}; stopped: token budget reached" in status.stdout, status.stdout
    # the audit log: the stop, then the cancel it made, both signed by the budget
    log = [(e["who"], e["action"]) for e in JobAudit(redis_client, keys).entries(job)]
    assert log[-2:] == [("interactor (budget)", "cancel"), ("interactor (budget)", "budget_stop")], log
    # the browser's job page, from the store
    page = job_page(s.results_store, job)
    assert f"{u['tokens']:,} tokens" in page and f"token budget {budget:,}" in page and 'id="budget-stop"' in page
