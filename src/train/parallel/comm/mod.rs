//! Communication between the processes (ranks) of a distributed run: the [`Comm`] interface,
//! its MPI implementation ([`mpi`], behind the `mpi` feature), ranks as threads of one process
//! ([`threads`], for tests), and the gradient sums built on them (docs/distributed.md).
//!
//! Every rank calls the same operations in the same order; a collective returns on a rank once
//! that rank's part is done. Point-to-point messages between two ranks arrive in the order they
//! were sent.

#[cfg(feature = "mpi")]
pub mod mpi;

use crate::kernels;
use std::sync::mpsc::{channel, Receiver, Sender};

/// The ranks of a job as seen from one of them.
pub trait Comm {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks the job has.
    fn size(&self) -> usize;
    /// Every rank's `mine` (all of the same length), concatenated in rank order.
    fn all_gather_f32(&self, mine: &[f32]) -> Vec<f32>;
    /// Every rank's `mine` (all of the same length), concatenated in rank order.
    fn all_gather_u64(&self, mine: &[u64]) -> Vec<u64>;
    /// `buf` of rank `root` copied into `buf` of every rank (all of the same length).
    fn broadcast_f32(&self, root: usize, buf: &mut [f32]);
    /// `buf` of rank `root` copied into `buf` of every rank (all of the same length).
    fn broadcast_u8(&self, root: usize, buf: &mut [u8]);
    /// `buf` replaced on every rank by the element-wise sum over the ranks, in an order the
    /// implementation chooses (so the low bits may depend on the number of ranks).
    fn all_reduce_sum_f32(&self, buf: &mut [f32]);
    /// Sends `buf` to rank `to`, which receives it with [`Comm::receive_f32`].
    fn send_f32(&self, to: usize, buf: &[f32]);
    /// Receives into `buf` (of the length sent) the next message from rank `from`.
    fn receive_f32(&self, from: usize, buf: &mut [f32]);
    /// Sends `buf` to rank `to` under `tag` (from 1) without waiting for the receiver: the
    /// message is buffered, so two ranks may send to each other at once (a pipeline does).
    fn post_f32(&self, to: usize, tag: u16, buf: &[f32]);
    /// Receives into `buf` (of the length sent) the next message that rank `from` posted under
    /// `tag`, whatever came before it under other tags.
    fn receive_posted_f32(&self, from: usize, tag: u16, buf: &mut [f32]);
    /// Makes room for `bytes` of posted messages not yet received, plus `messages` headers.
    fn reserve_posts(&self, _bytes: usize, _messages: usize) {}
    /// Starts receiving the next message of `len` values that rank `from` posts under `tag`,
    /// so that it can arrive while this rank computes; [`Comm::finish_receive`] waits for it.
    /// Receives started from one rank under one tag take its messages in the order started.
    /// By default nothing starts before the finish (a blocking receive then).
    fn start_receive(&self, from: usize, tag: u16, len: usize) -> Receiving {
        Receiving { from, tag, len, started: None }
    }
    /// The values of a receive started by [`Comm::start_receive`], once they are here.
    fn finish_receive(&self, r: Receiving) -> Vec<f32> {
        let mut buf = vec![0.0f32; r.len];
        self.receive_posted_f32(r.from, r.tag, &mut buf);
        buf
    }
}

/// A receive of a posted message under way ([`Comm::start_receive`]).
pub struct Receiving {
    pub from: usize,
    pub tag: u16,
    pub len: usize,
    /// What the implementation started (none: nothing yet).
    pub started: Option<Box<dyn std::any::Any>>,
}

/// Where a launcher (`mpirun`, `srun`) started this process as one of several ranks: how many
/// ranks and which one this is, from the environment the launcher sets. `None` for a process
/// started on its own, or as the only rank.
pub fn launched() -> Option<(usize, usize)> {
    let var = |names: &[&str]| {
        names.iter().find_map(|n| std::env::var(n).ok().and_then(|v| v.trim().parse().ok()))
    };
    // Open MPI's mpirun, then the PMI variables of MPICH's launcher and of Slurm.
    let size: usize = var(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])?;
    let rank = var(&["OMPI_COMM_WORLD_RANK", "PMI_RANK"]).unwrap_or(0);
    (size > 1).then_some((size, rank))
}

/// Broadcasts a byte string of any length from `root` (`mine` is read there only).
pub fn broadcast_bytes(comm: &dyn Comm, root: usize, mine: Vec<u8>) -> Vec<u8> {
    let mut len = (mine.len() as u64).to_le_bytes();
    comm.broadcast_u8(root, &mut len);
    let mut buf =
        if comm.rank() == root { mine } else { vec![0; u64::from_le_bytes(len) as usize] };
    comm.broadcast_u8(root, &mut buf);
    buf
}

/// Values per message of [`sum_in_order`]: the running sum travels in pieces of this size, so
/// that a rank adds its gradients to one piece while the next piece is on its way.
const PIECE: usize = 1 << 20;

/// The sum of the micro-batch gradients of every rank (`mine`: this rank's, in order, each of
/// length `n`), added exactly as one process adds them: from zero, every micro-batch of rank 0
/// in order, then those of rank 1, and so on, each with [`kernels::add_assign`]. The result is
/// bit-identical to one process summing the same micro-batches, for any number of ranks.
///
/// Ranks hold consecutive micro-batches, so the running sum passes from rank to rank (in
/// pieces of [`PIECE`] values, so that the ranks work on different pieces at once), and the
/// last rank broadcasts the total.
pub fn sum_in_order(comm: &dyn Comm, mine: &[Vec<f32>], n: usize) -> Vec<f32> {
    let ranks: Vec<usize> = (0..comm.size()).collect();
    let mut total = running_sum(comm, &ranks, mine, n);
    comm.broadcast_f32(comm.size() - 1, &mut total);
    total
}

/// [`sum_in_order`] among some of the ranks (`ranks`, in the order of their micro-batches;
/// every one of them calls this): the replicas of one pipeline stage.
pub fn sum_in_order_among(
    comm: &dyn Comm,
    ranks: &[usize],
    mine: &[Vec<f32>],
    n: usize,
) -> Vec<f32> {
    let mut total = running_sum(comm, ranks, mine, n);
    let last = ranks[ranks.len() - 1];
    if comm.rank() == last {
        ranks[..ranks.len() - 1].iter().for_each(|&r| comm.send_f32(r, &total));
    } else {
        comm.receive_f32(last, &mut total);
    }
    total
}

/// The running sum of [`sum_in_order`] through `ranks`: complete on the last of them.
fn running_sum(comm: &dyn Comm, ranks: &[usize], mine: &[Vec<f32>], n: usize) -> Vec<f32> {
    let at = ranks.iter().position(|&r| r == comm.rank()).expect("a rank of the sum");
    let mut total = kernels::zeros(n);
    let mut start = 0;
    while start < n {
        let piece = start..(start + PIECE).min(n);
        if at > 0 {
            comm.receive_f32(ranks[at - 1], &mut total[piece.clone()]);
        }
        for g in mine {
            kernels::add_assign(&mut total[piece.clone()], &g[piece.clone()]);
        }
        if at + 1 < ranks.len() {
            comm.send_f32(ranks[at + 1], &total[piece.clone()]);
        }
        start = piece.end;
    }
    total
}

/// The sum of the micro-batch gradients of every rank by the communication library's own
/// all-reduce: each rank adds its own in order, then the ranks' sums are added in the
/// library's order. Faster than [`sum_in_order`] on many ranks, but the low bits depend on the
/// number of ranks.
pub fn sum_all_reduce(comm: &dyn Comm, mine: &[Vec<f32>], n: usize) -> Vec<f32> {
    let mut total = kernels::zeros(n);
    for g in mine {
        kernels::add_assign(&mut total, g);
    }
    comm.all_reduce_sum_f32(&mut total);
    total
}

/// A message between two [`Threads`] ranks.
enum Message {
    F32(Vec<f32>),
    U64(Vec<u64>),
    U8(Vec<u8>),
    Posted(u16, Vec<f32>),
}

/// A posted message: its tag and values.
type Posted = (u16, Vec<f32>);

/// One rank of a job whose ranks are threads of one process, connected by channels: what runs
/// over ranks can be tested without MPI. Made by [`threads`].
pub struct Threads {
    rank: usize,
    /// `to[r]` sends to rank r.
    to: Vec<Sender<Message>>,
    /// `from[r]` receives from rank r.
    from: Vec<Receiver<Message>>,
    /// Posted messages from rank r that arrived before they were asked for.
    early: Vec<std::cell::RefCell<Vec<Posted>>>,
}

/// The `size` ranks of a job of threads; hand rank r to the r-th thread.
pub fn threads(size: usize) -> Vec<Threads> {
    // links[a][b]: the channel from rank a to rank b.
    let mut senders: Vec<Vec<Option<Sender<Message>>>> = (0..size).map(|_| Vec::new()).collect();
    let mut receivers: Vec<Vec<Option<Receiver<Message>>>> =
        (0..size).map(|_| (0..size).map(|_| None).collect()).collect();
    for (a, s) in senders.iter_mut().enumerate() {
        for r in receivers.iter_mut() {
            let (tx, rx) = channel();
            s.push(Some(tx));
            r[a] = Some(rx);
        }
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| Threads {
            rank,
            to: to.into_iter().flatten().collect(),
            from: from.into_iter().flatten().collect(),
            early: (0..size).map(|_| Default::default()).collect(),
        })
        .collect()
}

impl Threads {
    fn post(&self, to: usize, m: Message) {
        // A rank whose thread has ended cannot take part in anything more: the job is over.
        self.to[to].send(m).expect("a rank of the thread job has ended");
    }

    fn take(&self, from: usize) -> Message {
        self.from[from].recv().expect("a rank of the thread job has ended")
    }

    fn take_f32(&self, from: usize) -> Vec<f32> {
        match self.take(from) {
            Message::F32(v) => v,
            _ => panic!("rank {from} sent another kind of message than rank {} expects", self.rank),
        }
    }

    fn take_u64(&self, from: usize) -> Vec<u64> {
        match self.take(from) {
            Message::U64(v) => v,
            _ => panic!("rank {from} sent another kind of message than rank {} expects", self.rank),
        }
    }

    fn take_u8(&self, from: usize) -> Vec<u8> {
        match self.take(from) {
            Message::U8(v) => v,
            _ => panic!("rank {from} sent another kind of message than rank {} expects", self.rank),
        }
    }

    /// Everyone's `mine` in rank order (channels never block a sender, so all send first).
    fn gather<T: Clone>(
        &self,
        mine: &[T],
        wrap: fn(Vec<T>) -> Message,
        take: fn(&Self, usize) -> Vec<T>,
    ) -> Vec<T> {
        for r in (0..self.size()).filter(|&r| r != self.rank) {
            self.post(r, wrap(mine.to_vec()));
        }
        (0..self.size())
            .flat_map(|r| if r == self.rank { mine.to_vec() } else { take(self, r) })
            .collect()
    }
}

impl Comm for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn all_gather_f32(&self, mine: &[f32]) -> Vec<f32> {
        self.gather(mine, Message::F32, Self::take_f32)
    }

    fn all_gather_u64(&self, mine: &[u64]) -> Vec<u64> {
        self.gather(mine, Message::U64, Self::take_u64)
    }

    fn broadcast_f32(&self, root: usize, buf: &mut [f32]) {
        if self.rank == root {
            (0..self.size())
                .filter(|&r| r != root)
                .for_each(|r| self.post(r, Message::F32(buf.to_vec())));
        } else {
            buf.copy_from_slice(&self.take_f32(root));
        }
    }

    fn broadcast_u8(&self, root: usize, buf: &mut [u8]) {
        if self.rank == root {
            (0..self.size())
                .filter(|&r| r != root)
                .for_each(|r| self.post(r, Message::U8(buf.to_vec())));
        } else {
            buf.copy_from_slice(&self.take_u8(root));
        }
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        let all = self.all_gather_f32(buf);
        let mut sum = vec![0.0f32; buf.len()];
        for part in all.chunks(buf.len().max(1)) {
            kernels::add_assign(&mut sum, part);
        }
        buf.copy_from_slice(&sum);
    }

    fn send_f32(&self, to: usize, buf: &[f32]) {
        self.post(to, Message::F32(buf.to_vec()));
    }

    fn receive_f32(&self, from: usize, buf: &mut [f32]) {
        buf.copy_from_slice(&self.take_f32(from));
    }

    fn post_f32(&self, to: usize, tag: u16, buf: &[f32]) {
        self.post(to, Message::Posted(tag, buf.to_vec()));
    }

    fn receive_posted_f32(&self, from: usize, tag: u16, buf: &mut [f32]) {
        let mut early = self.early[from].borrow_mut();
        if let Some(i) = early.iter().position(|(t, _)| *t == tag) {
            buf.copy_from_slice(&early.remove(i).1);
            return;
        }
        loop {
            match self.take(from) {
                Message::Posted(t, v) if t == tag => return buf.copy_from_slice(&v),
                Message::Posted(t, v) => early.push((t, v)),
                _ => panic!(
                    "rank {from} sent another kind of message than rank {} expects",
                    self.rank
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gradients whose sum depends on the order of the additions in f32.
    fn grads(count: usize, n: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|i| {
                let mut g = crate::testutil::rand_vec(n, i as u64, 1.0);
                // Magnitudes from 1e-4 to 1e4: rounding differs by order.
                for (j, x) in g.iter_mut().enumerate() {
                    *x *= 10f32.powi(((i * 7 + j) % 9) as i32 - 4);
                }
                g
            })
            .collect()
    }

    /// Runs `f` on every rank of a job of `size` threads; the results in rank order.
    fn on_ranks<T: Send>(size: usize, f: impl Fn(&Threads) -> T + Sync) -> Vec<T> {
        let ranks = threads(size);
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(&c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_ordered_sum_is_bit_identical_to_one_process_for_any_number_of_ranks() {
        let (count, n) = (12, PIECE + 1000); // two pieces, the second one short
        let all = grads(count, n);
        let mut want = kernels::zeros(n);
        for g in &all {
            kernels::add_assign(&mut want, g);
        }
        for size in [1, 2, 3, 4, 6] {
            let per = count / size;
            let sums = on_ranks(size, |c| {
                let mine = &all[c.rank() * per..(c.rank() + 1) * per];
                sum_in_order(c, mine, n)
            });
            for (r, s) in sums.iter().enumerate() {
                assert!(
                    s.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{size} ranks: rank {r}'s sum differs from one process's"
                );
            }
        }
        // The all-reduce adds the same numbers in another order: equal up to rounding, and
        // here not bit for bit (the check above can tell the two apart).
        let sums = on_ranks(4, |c| sum_all_reduce(c, &all[c.rank() * 3..(c.rank() + 1) * 3], n));
        let scale: Vec<f32> = (0..n).map(|j| all.iter().map(|g| g[j].abs()).sum::<f32>()).collect();
        assert!(sums[0].iter().zip(&want).zip(&scale).all(|((a, b), s)| (a - b).abs() <= 1e-5 * s));
        assert!(sums[0].iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
        assert!(sums.iter().all(|s| s == &sums[0]), "every rank holds the same sum");
    }

    #[test]
    fn collectives_of_thread_ranks() {
        let out = on_ranks(3, |c| {
            let g = c.all_gather_u64(&[c.rank() as u64, 10]);
            let b =
                broadcast_bytes(c, 2, if c.rank() == 2 { b"from two".to_vec() } else { vec![] });
            let mut f = vec![c.rank() as f32; 2];
            c.broadcast_f32(1, &mut f);
            (g, b, f)
        });
        for (g, b, f) in out {
            assert_eq!(g, vec![0, 10, 1, 10, 2, 10]);
            assert_eq!(b, b"from two");
            assert_eq!(f, vec![1.0, 1.0]);
        }
    }
}
