//! Test hooks that make one rank of a job fail at a chosen step, as a crashed or killed process
//! would: the tests of distributed training and resumption use them (tests/distributed.rs).

/// A test hook: `ATTNRES_TEST_ABORT_AT=RANK:STEP` makes rank RANK die (`abort`) as it starts
/// step STEP (from 1), as a crashed or killed process would.
pub fn fault_point(rank: usize, step: usize) {
    static AT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    if *AT.get_or_init(|| hook_at("ATTNRES_TEST_ABORT_AT")) == Some((rank, step)) {
        std::process::abort();
    }
}

/// `RANK:STEP` of the test hook in the environment variable `var`.
fn hook_at(var: &str) -> Option<(usize, usize)> {
    let v = std::env::var(var).ok()?;
    let (r, s) = v.split_once(':')?;
    Some((r.trim().parse().ok()?, s.trim().parse().ok()?))
}

/// A test hook: `ATTNRES_TEST_KILL_AT=RANK:STEP` makes rank RANK kill itself with SIGKILL in
/// the middle of step STEP (from 1) of a pipeline, while the other ranks wait for its messages.
pub fn fault_point_kill(rank: usize, step: usize) {
    static AT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    if *AT.get_or_init(|| hook_at("ATTNRES_TEST_KILL_AT")) == Some((rank, step)) {
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("kill").args(["-KILL", &pid]).status();
        std::process::abort();
    }
}

/// A test hook: `ATTNRES_TEST_STOP_AT=RANK:STEP` makes rank RANK stop itself with SIGSTOP in
/// the middle of step STEP (from 1), as a process that hangs or is swapped out would: the
/// other ranks wait for it until their watchdog ends the job.
pub fn fault_point_stop(rank: usize, step: usize) {
    static AT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    if *AT.get_or_init(|| hook_at("ATTNRES_TEST_STOP_AT")) == Some((rank, step)) {
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("kill").args(["-STOP", &pid]).status();
    }
}
