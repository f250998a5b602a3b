//! The ranks of an MPI job this process may be one of.

use crate::args::Command;
use anyhow::{ensure, Result};
use attnres::train::parallel::Reported;

/// The ranks of an MPI job this process is one of (none when it runs alone). Only `train` runs
/// on several ranks; without the `mpi` feature no command does.
#[cfg(feature = "mpi")]
pub(crate) type Ranks = attnres::train::parallel::comm::mpi::Mpi;
#[cfg(not(feature = "mpi"))]
pub(crate) type Ranks = std::convert::Infallible;

#[cfg(feature = "mpi")]
pub(crate) fn ranks(command: &Command) -> Result<Option<Ranks>> {
    let Some((size, rank)) = attnres::train::parallel::comm::launched() else { return Ok(None) };
    let Command::Train(t) = command else {
        // Every rank would do the same work: say so once.
        ensure!(rank != 0, "only train runs on several ranks; start this command without mpirun ({size} ranks here)");
        return Err(Reported.into());
    };
    Ok(Some(Ranks::init(attnres::train::parallel::comm::mpi::timeout(t.comm_timeout)?)?))
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn ranks(_: &Command) -> Result<Option<Ranks>> {
    let Some((size, rank)) = attnres::train::parallel::comm::launched() else { return Ok(None) };
    ensure!(
        rank != 0,
        "this attnres was built without MPI, so the {size} ranks of mpirun would each train alone: build it with `cargo build --release --features mpi` (docs/distributed.md)"
    );
    Err(Reported.into())
}

/// Worker threads per rank when --threads is not given: the machine's cores shared among the
/// ranks running on it.
#[cfg(feature = "mpi")]
pub(crate) fn default_threads(r: &Ranks) -> usize {
    (attnres::kernels::cores() / r.local_size().max(1)).max(1)
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn default_threads(r: &Ranks) -> usize {
    match *r {}
}
