//! Log lines reach the terminal subscriber and, once added, the run's log file.

use burn_lora_train::report::{LOG_FILE, init_logging};

#[test]
fn log_lines_are_written_to_the_added_file() {
    let logging = init_logging().unwrap();
    // One subscriber per process.
    assert!(init_logging().is_err());
    tracing::info!("before the file");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LOG_FILE);
    logging.add_file(&path).unwrap();
    tracing::info!(step = 7, "a line for the file");
    tracing::debug!("below the default level");
    // The file writer is asynchronous: wait for the line.
    let start = std::time::Instant::now();
    let mut text = String::new();
    while !text.contains("a line for the file") && start.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        text = std::fs::read_to_string(&path).unwrap_or_default();
    }
    assert!(
        text.contains("a line for the file") && text.contains("step=7"),
        "{text}"
    );
    assert!(!text.contains("before the file"), "{text}");
    assert!(!text.contains("below the default level"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "no color codes in the file: {text:?}"
    );
}
