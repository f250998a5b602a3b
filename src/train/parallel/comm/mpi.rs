//! [`Comm`] over MPI (the `mpi` crate, on the system's MPI library). Only the thread that
//! initialised MPI calls it; the worker threads of the kernels never do.
//!
//! A rank that stops answering (stopped, swapped out, hung) would leave the others waiting in
//! MPI for ever: every blocking call says what it waits for to a watchdog thread, which ends
//! the job when a wait passes the timeout (`train --comm-timeout`), naming the rank waited for.

use super::{Comm, Receiving};
use anyhow::{Context, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest `--comm-timeout`, in seconds (a day).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// `--comm-timeout`, checked.
pub fn timeout(secs: u64) -> Result<Duration> {
    anyhow::ensure!(
        (1..=MAX_TIMEOUT_SECS).contains(&secs),
        "--comm-timeout must lie in 1..={MAX_TIMEOUT_SECS} seconds, got {secs}"
    );
    Ok(Duration::from_secs(secs))
}

/// What a rank waits for now, and since when: shared with its watchdog thread.
type Waiting = Arc<Mutex<Option<(Instant, String)>>>;

/// Starts the thread that ends the job when `waiting` has waited longer than `timeout`.
fn start_watchdog(rank: usize, timeout: Duration, waiting: Waiting) -> Result<()> {
    let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    std::thread::Builder::new()
        .name("comm-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(tick);
            let late = waiting.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(
                |(since, what)| (since.elapsed() > timeout).then(|| what.clone()),
            );
            if let Some(what) = late {
                crate::base::progress::log(&format!(
                    "error: rank {rank} waited more than {} s for {what}, which stopped answering (stopped, hung or swapped out): ending the job; continue it with --resume (the wait is --comm-timeout)",
                    timeout.as_secs()
                ));
                // At once, without MPI's teardown, which would wait for the silent rank too;
                // mpirun then ends the other ranks.
                extern "C" {
                    fn _exit(code: i32) -> !;
                }
                // SAFETY: ends the process; nothing of it is used afterwards.
                unsafe { _exit(1) }
            }
        })
        .context("cannot start the communication watchdog")?;
    Ok(())
}

/// MPI's world: every rank of the job. Dropping it finalises MPI, which every rank must reach.
pub struct Mpi {
    world: SimpleCommunicator,
    /// Ranks on this rank's machine (this one included).
    local: usize,
    /// Holds MPI's buffer for posted messages ([`Comm::post_f32`]).
    universe: std::cell::RefCell<Universe>,
    waiting: Waiting,
}

impl Mpi {
    /// Initialises MPI. Only the calling thread may use it (MPI's "funneled" level). A wait
    /// for other ranks longer than `timeout` ends the job.
    pub fn init(timeout: Duration) -> Result<Mpi> {
        let (universe, _) = mpi::initialize_with_threading(Threading::Funneled)
            .context("MPI is already initialised")?;
        let world = universe.world();
        let local = world.split_shared(world.rank()).size() as usize;
        let waiting = Waiting::default();
        start_watchdog(world.rank() as usize, timeout, waiting.clone())?;
        Ok(Mpi { world, local, universe: std::cell::RefCell::new(universe), waiting })
    }

    /// `f`, a call that waits for other ranks, watched: `what` names them for the error.
    fn wait<T>(&self, what: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), what()));
        let out = f();
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = None;
        out
    }

    /// The other ranks, for a collective's error.
    fn others(&self) -> String {
        format!("the other ranks ({} in all) in a collective operation", self.size())
    }

    /// How many ranks run on this rank's machine.
    pub fn local_size(&self) -> usize {
        self.local
    }

    /// Ends every rank of the job at once with exit status `code`: for a failure the other
    /// ranks have not heard of, which would otherwise leave them waiting.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl Comm for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_gather_f32(&self, mine: &[f32]) -> Vec<f32> {
        let mut all = vec![0.0f32; mine.len() * self.size()];
        self.wait(|| self.others(), || self.world.all_gather_into(mine, &mut all[..]));
        all
    }

    fn all_gather_u64(&self, mine: &[u64]) -> Vec<u64> {
        let mut all = vec![0u64; mine.len() * self.size()];
        self.wait(|| self.others(), || self.world.all_gather_into(mine, &mut all[..]));
        all
    }

    fn broadcast_f32(&self, root: usize, buf: &mut [f32]) {
        let what = || format!("rank {root} (a broadcast from it)");
        self.wait(what, || self.world.process_at_rank(root as i32).broadcast_into(buf));
    }

    fn broadcast_u8(&self, root: usize, buf: &mut [u8]) {
        let what = || format!("rank {root} (a broadcast from it)");
        self.wait(what, || self.world.process_at_rank(root as i32).broadcast_into(buf));
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        let mine = buf.to_vec();
        let sum = || self.world.all_reduce_into(&mine[..], buf, SystemOperation::sum());
        self.wait(|| self.others(), sum);
    }

    fn send_f32(&self, to: usize, buf: &[f32]) {
        let what = || format!("rank {to} (to take a message)");
        self.wait(what, || self.world.process_at_rank(to as i32).send(buf));
    }

    fn receive_f32(&self, from: usize, buf: &mut [f32]) {
        let what = || format!("rank {from} (a message from it)");
        self.wait(what, || self.world.process_at_rank(from as i32).receive_into(buf));
    }

    fn post_f32(&self, to: usize, tag: u16, buf: &[f32]) {
        // A buffered send (MPI_Bsend): returns once the message is copied out.
        self.world.process_at_rank(to as i32).buffered_send_with_tag(buf, tag as i32);
    }

    fn receive_posted_f32(&self, from: usize, tag: u16, buf: &mut [f32]) {
        let what = || format!("rank {from} (a pipeline message from it)");
        let at = self.world.process_at_rank(from as i32);
        self.wait(what, || at.receive_into_with_tag(buf, tag as i32));
    }

    fn start_receive(&self, from: usize, tag: u16, len: usize) -> Receiving {
        // The buffer lives on the heap until the request completes (`Immediate`'s drop).
        let buf: &'static mut [f32] = Box::leak(vec![0.0f32; len].into_boxed_slice());
        let ptr: *mut [f32] = buf;
        let request = self.world.process_at_rank(from as i32).immediate_receive_into_with_tag(
            StaticScope,
            buf,
            tag as i32,
        );
        let started = Immediate { request: Some(request), buf: Some(ptr) };
        Receiving { from, tag, len, started: Some(Box::new(started)) }
    }

    fn finish_receive(&self, r: Receiving) -> Vec<f32> {
        let started = r.started.and_then(|s| s.downcast::<Immediate>().ok());
        let Some(mut started) = started else {
            let mut buf = vec![0.0f32; r.len];
            self.receive_posted_f32(r.from, r.tag, &mut buf);
            return buf;
        };
        if let Some(request) = started.request.take() {
            let what = || format!("rank {} (a pipeline message from it)", r.from);
            self.wait(what, || request.wait_without_status());
        }
        started.take_values()
    }

    fn reserve_posts(&self, bytes: usize, messages: usize) {
        // MPI_BSEND_OVERHEAD is about a hundred bytes in Open MPI; leave room for more.
        let want = bytes + messages * 1024 + (1 << 20);
        let mut u = self.universe.borrow_mut();
        if u.buffer_size() < want {
            // Detaching waits for the messages posted into the old buffer to go out.
            u.set_buffer_size(want);
        }
    }
}

/// An immediate receive (`MPI_Irecv`) and the buffer it fills.
struct Immediate {
    request: Option<Request<'static, [f32], StaticScope>>,
    /// Leaked for the request; taken back once it completed (or was cancelled).
    buf: Option<*mut [f32]>,
}

impl Immediate {
    /// The values received, once the request completed.
    fn take_values(&mut self) -> Vec<f32> {
        // SAFETY: `buf` came from `Box::leak` in `start_receive` and its request completed (or
        // was cancelled and waited for), so nothing else refers to it; `take` hands it back
        // once.
        self.buf.take().map(|b| unsafe { Box::from_raw(b) }.into_vec()).unwrap_or_default()
    }
}

impl Drop for Immediate {
    fn drop(&mut self) {
        // A receive never finished (a step that ended in an error): cancel it, so that its
        // buffer can go.
        if let Some(request) = self.request.take() {
            request.cancel();
            request.wait_without_status();
        }
        self.take_values();
    }
}
