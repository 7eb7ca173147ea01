//! Ranks as threads of the test process (each with its own Store and ProcessGroup) on a fresh
//! loopback port, plus one rank as a real child process that gets killed.

use std::net::TcpListener;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use stagehand_contract::P2pOp;
use tch::{Kind, Tensor};

use super::{CommError, ProcessGroup, Store, Watched};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `body` as `n` ranks on threads and returns their results by rank. Rank 0 hosts the store
/// on a port the OS picked; every store lives until all ranks are done.
fn world<T, F>(n: usize, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, &Store) -> T + Send + Sync + 'static,
{
    world_with(n, TIMEOUT, body)
}

/// [`world`] with stores whose waits (and group rendezvous) time out after `store_timeout`.
fn world_with<T, F>(n: usize, store_timeout: Duration, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, &Store) -> T + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let body = Arc::new(body);
    let done = Arc::new(Latch::new(n));
    let mut listener = Some(listener);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (body, done) = (body.clone(), done.clone());
            let listener = if rank == 0 { listener.take() } else { None };
            thread::spawn(move || {
                let store = match listener {
                    Some(l) => Store::host(l, n, store_timeout),
                    None => Store::connect("127.0.0.1", port, n, false, store_timeout),
                };
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let store = store.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    body(rank, store)
                }));
                // Every store (rank 0's hosts the others) stays open until all ranks are done,
                // or a rank panicked and the others gave up waiting.
                done.arrive_and_wait(store_timeout + TIMEOUT);
                out.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect()
}

/// A barrier that gives up after a while, so one panicking rank cannot hang the others.
struct Latch {
    left: Mutex<usize>,
    all_done: Condvar,
}

impl Latch {
    fn new(n: usize) -> Latch {
        Latch {
            left: Mutex::new(n),
            all_done: Condvar::new(),
        }
    }

    fn arrive_and_wait(&self, limit: Duration) {
        let mut left = self.left.lock().unwrap();
        *left -= 1;
        self.all_done.notify_all();
        let _ = self
            .all_done
            .wait_timeout_while(left, limit, |left| *left > 0)
            .unwrap();
    }
}

fn gloo(store: &Store, rank: usize, timeout: Duration) -> ProcessGroup {
    ProcessGroup::gloo(store, rank, store.world_size(), timeout)
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
}

fn samples() -> Vec<Tensor> {
    vec![
        Tensor::from_slice(&[1.5f32, -2.0, 3.25]),
        Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).reshape([2, 3, 4]),
        Tensor::from_slice(&[i64::MAX, -7, 0, 42]).reshape([2, 2]),
        Tensor::from_slice(&[0.1f64]),
        Tensor::ones([1, 1, 1, 5], (Kind::Int64, tch::Device::Cpu)),
    ]
}

#[test]
fn store_rendezvous_shares_keys_between_ranks() {
    let seen = world(3, |rank, store| {
        assert_eq!(store.world_size(), 3);
        store
            .set(&format!("hello/{rank}"), format!("from {rank}").as_bytes())
            .unwrap();
        (0..3)
            .map(|r| String::from_utf8(store.get(&format!("hello/{r}")).unwrap()).unwrap())
            .collect::<Vec<_>>()
    });
    for values in seen {
        assert_eq!(values, ["from 0", "from 1", "from 2"]);
    }
}

/// A master address that names no host fails at once, saying so, not after the whole timeout
/// as though rank 0 did not answer.
#[test]
fn a_master_address_that_does_not_resolve_fails_at_once_saying_so() {
    let started = std::time::Instant::now();
    let error = match Store::connect("no.such.host.invalid", 29500, 2, false, Duration::from_secs(30)) {
        Ok(_) => panic!("connected to a name that does not resolve"),
        Err(e) => e.to_string(),
    };
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert!(
        error.contains("no.such.host.invalid does not resolve to an address")
            && error.contains("--master-addr"),
        "{error}"
    );
}

#[test]
fn send_recv_moves_tensors_of_several_shapes_and_dtypes() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        assert_eq!((pg.rank(), pg.size()), (rank, 2));
        for (i, sample) in samples().into_iter().enumerate() {
            if rank == 0 {
                pg.send(&sample, 1, i as u32).unwrap().wait().unwrap();
            } else {
                let mut got = sample.zeros_like();
                pg.recv(&mut got, 0, i as u32).unwrap().wait().unwrap();
                assert_eq!(got, sample, "sample {i}");
                assert_eq!(got.kind(), sample.kind());
            }
        }
    });
}

#[test]
fn concurrent_sends_with_different_tags_reach_their_own_recvs() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let tags = [3u32, 11, 7, 0];
        if rank == 0 {
            let sent: Vec<Tensor> = tags
                .iter()
                .map(|&t| Tensor::full([1000], t as f64, (Kind::Float, tch::Device::Cpu)))
                .collect();
            let works: Vec<_> = sent
                .iter()
                .zip(tags)
                .map(|(t, tag)| pg.send(t, 1, tag).unwrap())
                .collect();
            for w in works {
                w.wait().unwrap();
            }
        } else {
            // Posted in the opposite order from the sends.
            let mut got: Vec<Tensor> = tags
                .iter()
                .map(|_| Tensor::zeros([1000], (Kind::Float, tch::Device::Cpu)))
                .collect();
            let works: Vec<_> = got
                .iter_mut()
                .zip(tags)
                .rev()
                .map(|(t, tag)| pg.recv(t, 0, tag).unwrap())
                .collect();
            for w in works {
                w.wait().unwrap();
            }
            for (t, tag) in got.iter().zip(tags) {
                assert_eq!(t.min().double_value(&[]), tag as f64);
                assert_eq!(t.max().double_value(&[]), tag as f64);
            }
        }
    });
}

/// Polls `watched` until it says it has ended.
fn until_ended(watched: &Watched) {
    let deadline = Instant::now() + TIMEOUT;
    while !watched.is_completed() {
        assert!(Instant::now() < deadline, "never said it ended");
        thread::sleep(Duration::from_millis(1));
    }
}

/// A Gloo receive posted with room for more than the message takes the message into its first
/// bytes and ends, leaving the rest as it was, in order with the next message on the same tag:
/// a framed message's payload receive is posted ahead with room for its dense form
/// (pipeline/exec/transfer.rs), its size read from the header. Gloo's TCP transport allows it
/// (a message longer than the receive aborts the process); this checks the libtorch built against.
#[test]
fn a_receive_with_room_to_spare_takes_a_shorter_message() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let short = Tensor::arange(100, (Kind::Uint8, tch::Device::Cpu));
        let full = Tensor::arange(256, (Kind::Int, tch::Device::Cpu)).to_kind(Kind::Uint8);
        if rank == 0 {
            pg.send(&short, 1, 9).unwrap().wait().unwrap();
            pg.send(&full, 1, 9).unwrap().wait().unwrap();
        } else {
            let mut first = Tensor::full([256], 7, (Kind::Uint8, tch::Device::Cpu));
            let mut second = first.zeros_like();
            let (a, b) = (
                pg.recv(&mut first, 0, 9).unwrap(),
                pg.recv(&mut second, 0, 9).unwrap(),
            );
            a.wait().unwrap();
            b.wait().unwrap();
            assert_eq!(first.narrow(0, 0, 100), short);
            assert_eq!(
                first.narrow(0, 100, 156),
                Tensor::full([156], 7, (Kind::Uint8, tch::Device::Cpu))
            );
            assert_eq!(second, full);
        }
    });
}

/// A watched receive says it has ended only once its message is in, without blocking, and its
/// wait then returns the message; a watched send ends once its receive is posted.
#[test]
fn a_watched_receive_says_it_has_ended_once_its_message_is_in() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let sent = Tensor::arange(4096, (Kind::Float, tch::Device::Cpu));
        if rank == 0 {
            // Sent only after the receiver has seen its receive still open.
            store.get("checked").unwrap();
            let send = Watched::new(pg.send(&sent, 1, 5).unwrap()).unwrap();
            until_ended(&send);
            send.wait().unwrap();
        } else {
            let mut got = sent.zeros_like();
            let recv = Watched::new(pg.recv(&mut got, 0, 5).unwrap()).unwrap();
            thread::sleep(Duration::from_millis(50));
            assert!(!recv.is_completed(), "ended before anything was sent");
            store.set("checked", b"1").unwrap();
            until_ended(&recv);
            recv.wait().unwrap();
            assert_eq!(got, sent);
        }
    });
}

/// The group's timeout counts from the wait on a watched operation, not from the watch (a
/// message may take longer than the timeout to come while the rank computes), and a wait that
/// times out leaves the group usable; a watched receive dropped unwaited returns at once.
#[test]
fn a_watched_operation_keeps_the_timeout_from_its_wait_and_leaves_the_group_usable() {
    let timeout = Duration::from_secs(2);
    world(2, move |rank, store| {
        let pg = gloo(store, rank, timeout);
        let sent = Tensor::arange(64, (Kind::Float, tch::Device::Cpu));
        if rank == 0 {
            store.get("late").unwrap();
            pg.send(&sent, 1, 1).unwrap().wait().unwrap();
            store.get("usable").unwrap();
            pg.send(&sent, 1, 3).unwrap().wait().unwrap();
        } else {
            // Sent one and a half timeouts after the watch.
            let mut got = sent.zeros_like();
            let late = Watched::new(pg.recv(&mut got, 0, 1).unwrap()).unwrap();
            thread::sleep(timeout * 3 / 2);
            store.set("late", b"1").unwrap();
            late.wait().unwrap();
            assert_eq!(got, sent);
            // Never sent: the wait ends with the timeout, counted from it.
            let mut never = sent.zeros_like();
            let watched = Watched::new(pg.recv(&mut never, 0, 2).unwrap()).unwrap();
            thread::sleep(timeout / 2);
            let started = Instant::now();
            let err = watched.wait().unwrap_err();
            let silent = err.silent_peer();
            let err = err.to_string();
            let waited = started.elapsed();
            assert!(err.contains("timed out") && err.contains("rank 0"), "{err}");
            assert_eq!(silent, Some((0, P2pOp::Recv)), "{err}");
            assert!(waited >= timeout * 9 / 10 && waited < timeout * 3, "{waited:?}");
            // Dropped unwaited: aborted, not waited out.
            let mut dropped = sent.zeros_like();
            let watched = Watched::new(pg.recv(&mut dropped, 0, 4).unwrap()).unwrap();
            let started = Instant::now();
            drop(watched);
            assert!(started.elapsed() < timeout / 2, "{:?}", started.elapsed());
            // The group still carries messages.
            let mut again = sent.zeros_like();
            let work = pg.recv(&mut again, 0, 3).unwrap();
            store.set("usable", b"1").unwrap();
            work.wait().unwrap();
            assert_eq!(again, sent);
        }
    });
}

#[test]
fn all_reduce_sums_over_the_world_and_over_a_subgroup() {
    let results = world(3, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let value = (rank + 1) as f64;
        let tensors = vec![
            Tensor::full([4], value, (Kind::Float, tch::Device::Cpu)),
            Tensor::full([2, 3], value as i64, (Kind::Int64, tch::Device::Cpu)),
            Tensor::full([3, 5], 10.0 * value, (Kind::Float, tch::Device::Cpu)),
        ];
        pg.all_reduce_sum(&tensors).unwrap().wait().unwrap();
        assert_eq!(
            tensors[2],
            Tensor::full([3, 5], 60.0, (Kind::Float, tch::Device::Cpu))
        );
        let world_sum = (tensors[0].double_value(&[0]), tensors[1].int64_value(&[1, 2]));

        let sub = pg.subgroup(store, "evens", &[0, 2]).unwrap();
        let sub_sum = sub.map(|sub| {
            assert_eq!(sub.size(), 2);
            assert_eq!(sub.rank(), rank / 2);
            assert_eq!(sub.ranks(), [0, 2]);
            let t = vec![Tensor::full([3], value, (Kind::Float, tch::Device::Cpu))];
            sub.all_reduce_sum(&t).unwrap().wait().unwrap();
            // Point-to-point inside the subgroup uses subgroup ranks.
            let mut other = Tensor::zeros([1], (Kind::Int64, tch::Device::Cpu));
            let mine = Tensor::from_slice(&[rank as i64]);
            let peer = 1 - sub.rank();
            let send = sub.send(&mine, peer, 5).unwrap();
            sub.recv(&mut other, peer, 5).unwrap().wait().unwrap();
            send.wait().unwrap();
            (t[0].double_value(&[2]), other.int64_value(&[0]))
        });
        pg.barrier().unwrap();
        (world_sum, sub_sum)
    });
    for (rank, (world_sum, sub_sum)) in results.into_iter().enumerate() {
        assert_eq!(world_sum, (6.0, 6), "rank {rank}");
        match rank {
            1 => assert_eq!(sub_sum, None),
            _ => assert_eq!(sub_sum, Some((4.0, 2 - rank as i64))),
        }
    }
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    let waited = world(3, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        pg.barrier().unwrap();
        if rank == 2 {
            thread::sleep(Duration::from_millis(400));
        }
        let start = Instant::now();
        pg.barrier().unwrap();
        start.elapsed()
    });
    assert!(waited[0] >= Duration::from_millis(300), "{waited:?}");
    assert!(waited[1] >= Duration::from_millis(300), "{waited:?}");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let t = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
        let err = pg.send(&t, rank, 0).unwrap_err();
        assert!(matches!(err, CommError::Invalid(_)), "{err}");
        let err = pg.send(&t, 5, 0).unwrap_err();
        assert!(err.to_string().contains("2 ranks"), "{err}");
        let err = pg.send(&t, 1 - rank, u32::MAX).unwrap_err();
        assert!(err.to_string().contains("tag"), "{err}");
        let err = pg.subgroup(store, "bad", &[1, 0]).unwrap_err();
        assert!(err.to_string().contains("sorted"), "{err}");
        let err = pg.subgroup(store, "bad", &[0, 9]).unwrap_err();
        assert!(err.to_string().contains("rank 9"), "{err}");
        if crate::cuda::nccl().is_err() {
            let err = ProcessGroup::nccl(store, rank, 2, 0, TIMEOUT).unwrap_err();
            assert!(matches!(err, CommError::Unsupported(_)), "{err}");
        }
        pg.barrier().unwrap();
    });
}

#[test]
fn a_tensor_c10d_rejects_is_an_error() {
    world(2, |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        if rank == 0 {
            let strided = Tensor::zeros([4, 4], (Kind::Float, tch::Device::Cpu)).transpose(0, 1);
            let err = pg.send(&strided, 1, 0).unwrap_err();
            assert!(
                matches!(
                    err,
                    CommError::Op {
                        op: "send",
                        peer: Some(1),
                        ..
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains("contiguous"), "{err}");
        }
        pg.barrier().unwrap();
    });
}

use super::Work;

#[test]
fn rendezvous_with_nobody_listening_times_out_naming_the_address() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err = Store::connect("127.0.0.1", port, 2, false, Duration::from_secs(2))
        .err()
        .unwrap();
    let elapsed = start.elapsed();
    let message = err.to_string();
    assert!(matches!(err, CommError::Rendezvous { .. }), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(message.contains("is rank 0 running"), "{message}");
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}: {message}");
}

#[test]
fn a_master_whose_ranks_never_come_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let start = Instant::now();
    let err = Store::host(listener, 3, Duration::from_secs(2)).err().unwrap();
    assert!(start.elapsed() < Duration::from_secs(6), "{err}");
    assert!(err.to_string().contains("did all 3 ranks start"), "{err}");
}

#[test]
fn a_subgroup_a_member_never_creates_fails_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    world_with(2, timeout, move |rank, store| {
        let pg = gloo(store, rank, timeout);
        if rank == 0 {
            let start = Instant::now();
            let err = pg.subgroup(store, "lonely", &[0, 1]).unwrap_err();
            assert!(
                start.elapsed() < timeout + Duration::from_secs(3),
                "{:?}",
                start.elapsed()
            );
            assert!(
                err.to_string()
                    .contains("\"stagehand/group/lonely\" of ranks [0, 1]"),
                "{err}"
            );
        }
        // Rank 1 skips the subgroup; `world_with` keeps its store open until rank 0 is done.
    });
}

#[test]
fn recv_from_a_rank_that_dropped_its_group_fails_within_the_timeout() {
    let timeout = Duration::from_secs(3);
    world(2, move |rank, store| {
        let pg = gloo(store, rank, timeout);
        pg.barrier().unwrap();
        if rank == 1 {
            drop(pg);
            return;
        }
        let start = Instant::now();
        let mut t = Tensor::zeros([16], (Kind::Float, tch::Device::Cpu));
        let err = pg.recv(&mut t, 1, 0).and_then(Work::wait).unwrap_err();
        assert!(
            start.elapsed() < timeout + Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        assert!(matches!(err, CommError::Op { peer: Some(1), .. }), "{err}");
        assert!(err.to_string().contains("rank 1"), "{err}");
        // A peer gone is not a silent one: it failed itself.
        assert_eq!(err.silent_peer(), None, "{err}");
    });
}

#[test]
fn recv_from_a_silent_rank_times_out() {
    let timeout = Duration::from_secs(1);
    world(2, move |rank, store| {
        let pg = gloo(store, rank, timeout);
        if rank == 0 {
            let start = Instant::now();
            let mut t = Tensor::zeros([16], (Kind::Float, tch::Device::Cpu));
            let err = pg.recv(&mut t, 1, 0).and_then(Work::wait).unwrap_err();
            let elapsed = start.elapsed();
            assert!(elapsed >= Duration::from_millis(900), "{elapsed:?} {err}");
            assert!(elapsed < Duration::from_secs(4), "{elapsed:?} {err}");
            assert!(err.to_string().contains("rank 1"), "{err}");
            assert_eq!(err.silent_peer(), Some((1, P2pOp::Recv)), "{err}");
        }
        // Keep rank 1's group alive (and silent) until rank 0 has seen the timeout.
        store.set(&format!("silent/{rank}"), b"done").unwrap();
        store.get(&format!("silent/{}", 1 - rank)).unwrap();
    });
}

/// The child half of `ops_with_a_killed_process_fail_within_the_timeout`; does nothing unless
/// that test started this process.
#[test]
#[ignore = "run by another test as a child process"]
fn child_rank() {
    let Ok(port) = std::env::var("STAGEHAND_COMM_CHILD_PORT") else {
        return;
    };
    let store = Store::connect("127.0.0.1", port.parse().unwrap(), 2, false, TIMEOUT).unwrap();
    let pg = gloo(&store, 1, TIMEOUT);
    let t = vec![Tensor::ones([4], (Kind::Float, tch::Device::Cpu))];
    pg.all_reduce_sum(&t).unwrap().wait().unwrap();
    // Wait to be killed.
    thread::sleep(Duration::from_secs(60));
}

#[test]
fn ops_with_a_killed_process_fail_within_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "comm::tests::child_rank",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("STAGEHAND_COMM_CHILD_PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let timeout = Duration::from_secs(5);
    let store = Store::host(listener, 2, TIMEOUT).unwrap();
    let pg = gloo(&store, 0, timeout);
    let t = vec![Tensor::ones([4], (Kind::Float, tch::Device::Cpu))];
    pg.all_reduce_sum(&t).unwrap().wait().unwrap();
    assert_eq!(t[0].double_value(&[0]), 2.0);

    let mut pending = Tensor::zeros([1 << 16], (Kind::Float, tch::Device::Cpu));
    let recv = pg.recv(&mut pending, 1, 9).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    let err = recv.wait().unwrap_err();
    assert!(
        start.elapsed() < timeout + Duration::from_secs(2),
        "{:?} {err}",
        start.elapsed()
    );
    assert!(err.to_string().contains("rank 1"), "{err}");

    // Later operations fail too, without hanging.
    let start = Instant::now();
    let result = pg.all_reduce_sum(&t).and_then(Work::wait);
    assert!(result.is_err());
    assert!(
        start.elapsed() < timeout + Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

/// 2-rank send/recv throughput of a 64 MiB float tensor: `cargo test --release -p
/// stagehand-runtime comm::tests::send_recv_throughput -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn send_recv_throughput() {
    const ROUNDS: usize = 20;
    let elements = 16 << 20; // 64 MiB of f32
    let rates = world(2, move |rank, store| {
        let pg = gloo(store, rank, TIMEOUT);
        let mut t = Tensor::ones([elements], (Kind::Float, tch::Device::Cpu));
        let step = |pg: &ProcessGroup, t: &mut Tensor| {
            if rank == 0 {
                pg.send(t, 1, 0).unwrap().wait().unwrap();
            } else {
                pg.recv(t, 0, 0).unwrap().wait().unwrap();
            }
        };
        for _ in 0..3 {
            step(&pg, &mut t);
        }
        pg.barrier().unwrap();
        let start = Instant::now();
        for _ in 0..ROUNDS {
            step(&pg, &mut t);
        }
        pg.barrier().unwrap();
        (ROUNDS as f64) * (elements as f64) * 4.0 / start.elapsed().as_secs_f64()
    });
    println!(
        "64 MiB send/recv over gloo on loopback: {:.2} GB/s",
        rates[1] / 1e9
    );
}

/// A one-rank NCCL group all-reduces on a GPU. Without a GPU it says so loudly and checks only
/// that asking for NCCL on a device that does not exist is an error, not a crash.
#[test]
fn nccl_group_of_one_rank() {
    let cuda = match crate::cuda::cuda() {
        Ok(cuda) => cuda,
        Err(reason) => {
            eprintln!("SKIPPED nccl_group_of_one_rank: CUDA is unavailable: {reason}");
            return;
        }
    };
    world(1, |rank, store| {
        let result = ProcessGroup::nccl(store, rank, 1, 0, TIMEOUT);
        if cuda.device_count() == 0 {
            eprintln!("SKIPPED nccl_group_of_one_rank on a GPU: this machine has no CUDA device");
            let err = result.unwrap_err();
            assert!(err.to_string().contains("does not exist"), "{err}");
            return;
        }
        let pg = result.unwrap();
        let t = vec![
            Tensor::ones([8], (Kind::Float, tch::Device::Cuda(0))),
            Tensor::ones([2, 2], (Kind::Float, tch::Device::Cuda(0))),
        ];
        pg.all_reduce_sum(&t).unwrap().wait().unwrap();
        crate::cuda::synchronize(tch::Device::Cuda(0)).unwrap();
        assert_eq!(t[1].sum(Kind::Float).double_value(&[]), 4.0);
        pg.barrier().unwrap();
    });
}

/// NCCL's interface is found from the address of the route to the master: the loopback address
/// is on `lo`, an address this host does not hold is on none.
#[test]
fn the_interface_holding_an_address_is_found_by_name() {
    use std::net::IpAddr;
    let loopback = super::group::interface_of(IpAddr::from([127, 0, 0, 1]));
    assert_eq!(loopback.as_deref(), Some("lo"));
    // TEST-NET-1 (RFC 5737): documentation only, never a host's.
    assert_eq!(super::group::interface_of(IpAddr::from([192, 0, 2, 1])), None);
}
