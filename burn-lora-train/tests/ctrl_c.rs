//! The first Ctrl-C (SIGINT) sets the stop flag instead of killing the process.

use std::time::{Duration, Instant};

use burn_lora_train::report::StopFlag;

#[test]
fn sigint_sets_the_stop_flag() {
    let flag = StopFlag::install().unwrap();
    assert!(!flag.is_set());
    // Installing a second handler in the same process is refused, not silently replaced.
    assert!(StopFlag::install().is_err());
    let status = std::process::Command::new("kill")
        .args(["-INT", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    while !flag.is_set() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(flag.is_set(), "the handler did not run within 10 s");
}
