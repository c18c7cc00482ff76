"""pipelines.lm through real sidecars: global shuffle by seed, exact resume from feed.state()."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from pipelines import lm

pytestmark = pytest.mark.processes

SEQ_LEN = 16
CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)  # outside a pool: any path
TEXT = bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8))


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="32MiB",
                                    imports=["pipelines.lm"]) as c:
    yield c


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  directory = tmp_path_factory.mktemp("corpus")
  lm.write_corpus(directory, [TEXT], record_bytes=256, shard_bytes=1024)
  return str(directory)


def _batches(cluster, data, n, *, seed=0, state=None):
  rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
  with cluster.controller() as ctl, ctl.feed(
      "lm", global_batch_size=8, sharding=rows, seed=seed, state=state,
      kwargs={"data": data, "seq_len": SEQ_LEN}) as feed:
    batches, states = [], []
    for _ in range(n):
      batches.append(np.asarray(next(feed)["tokens"]))
      states.append(feed.state())
  return batches, states


def _index(tokens: np.ndarray) -> int:
  """Which sequence ``tokens`` is (random bytes: each 17-byte span occurs once)."""
  start = TEXT.find(bytes(tokens.astype(np.uint8)))
  assert start >= 0 and start % SEQ_LEN == 0
  return start // SEQ_LEN


def test_batches_are_a_seeded_permutation_of_the_sequences(cluster, data):
  batches, _ = _batches(cluster, data, 6)
  assert all(b.shape == (8, SEQ_LEN + 1) and b.dtype == np.int32 for b in batches)
  seen = [_index(row) for b in batches for row in b]
  assert len(set(seen)) == len(seen)  # no sequence twice within the epoch
  assert seen != sorted(seen)  # shuffled
  again, _ = _batches(cluster, data, 6)
  assert all(np.array_equal(a, b) for a, b in zip(batches, again))
  other, _ = _batches(cluster, data, 6, seed=1)
  assert not all(np.array_equal(a, b) for a, b in zip(batches, other))


def test_a_saved_state_resumes_at_exactly_the_next_batch(cluster, data):
  # 4000 bytes: 249 sequences, 31 batches an epoch: batch 33 is in the second epoch.
  batches, states = _batches(cluster, data, 34)
  for after in (2, 30, 31):
    resumed, _ = _batches(cluster, data, 3, state=states[after])
    for got, want in zip(resumed, batches[after + 1:]):
      np.testing.assert_array_equal(got, want)


def test_a_mistyped_data_directory_is_the_pipelines_error_in_the_trainer_and_the_log(
    cluster, data, tmp_path):
  # Issue 62 item 1: `--data /tmp/lm-dta` once read "HostLostError: the sidecar of host 0
  # ... is gone during stream 'lm'", with the sidecar alive and nothing in its log.
  typo = str(tmp_path / "lm-dta")
  # Issue 71 item 2: one type to catch for whatever the pipeline raised (a PipelineError,
  # the cause's type kept), and still the NotFoundError code catches today.
  with pytest.raises(sidecar.PipelineError) as info:
    _batches(cluster, typo, 1)
  e = info.value
  assert isinstance(e, sidecar.NotFoundError) and isinstance(e, FileNotFoundError)
  assert not isinstance(e, sidecar.HostLostError)
  assert (e.pipeline, e.host_id, e.remote_type) == ("lm", 0, "NotFoundError")
  assert str(e).startswith(f"pipeline 'lm' on host 0 raised NotFoundError: no corpus manifest "
                           f"at {typo}/manifest.json: run examples/lm/prepare.py --out {typo}")
  for h in (0,):  # the sidecar it came from logged it, with its traceback (the trainer
    log = cluster.log(h)  # may close host 1's stream before that one opened the corpus)
    assert (f"ERROR sidecar._src.server.calls.stream_runner: pipeline 'lm' (a feed) raised "
            f"NotFoundError: no corpus manifest at {typo}") in log, log[-3000:]
    assert "in corpus_identity" in log  # the first to read it, as the pipeline would
  batches, _ = _batches(cluster, data, 1)  # and serve on
  assert batches[0].shape == (8, SEQ_LEN + 1)


def test_a_state_resumed_on_a_re_prepared_corpus_is_refused_naming_both(cluster, tmp_path):
  """Before: a checkpoint made on one corpus resumed at its position in another (the issue:
  12 MB, then re-prepared as 2 MB), with no word. The state records the corpus's identity
  (its manifest's digest and size), and the sidecar refuses a resume on another."""
  lm.write_corpus(tmp_path, [TEXT], record_bytes=256, shard_bytes=1024)
  made_on = lm.corpus_identity(CTX, data=str(tmp_path), seq_len=SEQ_LEN)
  _, states = _batches(cluster, str(tmp_path), 2)
  assert states[-1]["data"] == made_on and "(4,000 bytes)" in made_on
  resumed, _ = _batches(cluster, str(tmp_path), 1, state=states[-1])  # the same corpus: on
  lm.write_corpus(tmp_path, [TEXT[:2000]], record_bytes=256, shard_bytes=1024)
  now = lm.corpus_identity(CTX, data=str(tmp_path), seq_len=SEQ_LEN)
  assert "(2,000 bytes)" in now
  with pytest.raises(sidecar.PipelineInvalidArgumentError) as refused:
    _batches(cluster, str(tmp_path), 1, state=states[-1])
  assert isinstance(refused.value, sidecar.InvalidArgumentError)
  assert (f"the state it resumes from was made from {made_on!r}, but with kwargs "
          f"['data', 'seq_len'] it now reads {now!r}") in str(refused.value)
