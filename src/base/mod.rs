//! What every other layer stands on: nothing here knows of models.
//!
//! - [`fs`]: files written atomically, reads that name the file in their errors, the cache folder.
//! - [`alloc`]: the binary's allocator, which recycles large buffers between steps.
//! - [`profile`]: per-phase timers.
//! - [`version`]: the code version a run records.
//! - [`progress`]: log lines and progress bars.
//! - [`memory`]: the machine's memory, and byte counts for people.

pub mod alloc;
pub mod fs;
pub mod memory;
pub mod profile;
pub mod progress;
pub mod version;
