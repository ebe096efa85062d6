//! The config loader: TOML text and `--set` overrides to a validated `Config`, or an error that
//! says where; a config that loads renders as TOML that loads again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrace::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // After the first NUL, each line is one `--set` override.
    let (toml, sets) = match text.split_once('\0') {
        Some((toml, sets)) => (toml, sets.lines().map(String::from).collect()),
        None => (&*text, Vec::new()),
    };
    match Config::parse(toml, "fuzz.toml", &sets) {
        Ok(config) => {
            config.validate().expect("a loaded config validates");
            let _ = config.default_evaluator();
            let rendered = config.redacted_toml();
            if let Err(e) = Config::parse(&rendered, "rendered", &[]) {
                panic!("the rendered config does not load: {e}\n{rendered}");
            }
        }
        Err(e) => assert!(!e.message.trim().is_empty()),
    }
});
