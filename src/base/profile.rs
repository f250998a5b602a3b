//! An opt-in wall-clock profile of the engine's phases (`attnres bench --profile`): each phase
//! adds its elapsed time to a named counter. Disabled, a phase costs one atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (f64, u64)>> = Mutex::new(BTreeMap::new());

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Runs `f`, charging its wall time to `name` when profiling is on.
#[inline]
pub fn phase<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let t = Instant::now();
    let out = f();
    let dt = t.elapsed().as_secs_f64();
    let mut m = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    let e = m.entry(name).or_insert((0.0, 0));
    e.0 += dt;
    e.1 += 1;
    out
}

/// Takes the accumulated totals `(name, seconds, calls)`, largest first, and resets them.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    let mut m = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<_> = std::mem::take(&mut *m).into_iter().map(|(k, (s, n))| (k, s, n)).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}
