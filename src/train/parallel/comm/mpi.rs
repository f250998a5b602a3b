//! [`Comm`] over MPI (the `mpi` crate, on the system's MPI library). Only the thread that
//! initialised MPI calls it; the worker threads of the kernels never do.

use super::{Comm, Receiving};
use anyhow::{Context, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

/// MPI's world: every rank of the job. Dropping it finalises MPI, which every rank must reach.
pub struct Mpi {
    world: SimpleCommunicator,
    /// Ranks on this rank's machine (this one included).
    local: usize,
    /// Holds MPI's buffer for posted messages ([`Comm::post_f32`]).
    universe: std::cell::RefCell<Universe>,
}

impl Mpi {
    /// Initialises MPI. Only the calling thread may use it (MPI's "funneled" level).
    pub fn init() -> Result<Mpi> {
        let (universe, _) = mpi::initialize_with_threading(Threading::Funneled)
            .context("MPI is already initialised")?;
        let world = universe.world();
        let local = world.split_shared(world.rank()).size() as usize;
        Ok(Mpi { world, local, universe: std::cell::RefCell::new(universe) })
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
        self.world.all_gather_into(mine, &mut all[..]);
        all
    }

    fn all_gather_u64(&self, mine: &[u64]) -> Vec<u64> {
        let mut all = vec![0u64; mine.len() * self.size()];
        self.world.all_gather_into(mine, &mut all[..]);
        all
    }

    fn broadcast_f32(&self, root: usize, buf: &mut [f32]) {
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }

    fn broadcast_u8(&self, root: usize, buf: &mut [u8]) {
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        let mine = buf.to_vec();
        self.world.all_reduce_into(&mine[..], buf, SystemOperation::sum());
    }

    fn send_f32(&self, to: usize, buf: &[f32]) {
        self.world.process_at_rank(to as i32).send(buf);
    }

    fn receive_f32(&self, from: usize, buf: &mut [f32]) {
        self.world.process_at_rank(from as i32).receive_into(buf);
    }

    fn post_f32(&self, to: usize, tag: u16, buf: &[f32]) {
        // A buffered send (MPI_Bsend): returns once the message is copied out.
        self.world.process_at_rank(to as i32).buffered_send_with_tag(buf, tag as i32);
    }

    fn receive_posted_f32(&self, from: usize, tag: u16, buf: &mut [f32]) {
        self.world.process_at_rank(from as i32).receive_into_with_tag(buf, tag as i32);
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
            request.wait_without_status();
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
