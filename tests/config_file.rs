//! The shipped config file parses and documents exactly the built-in defaults.

use std::path::Path;

use fencegate::config::{Config, Overrides};

#[test]
fn shipped_config_is_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/fencegate.toml");
    let loaded = Config::load(Some(&path), Vec::new(), &Overrides::default()).unwrap();
    let defaults = Config::default();
    // Compare through TOML so every key (and every future key) is covered.
    assert_eq!(
        toml::to_string(&loaded).unwrap(),
        toml::to_string(&defaults).unwrap()
    );
}

#[test]
fn every_default_key_is_documented_in_the_shipped_file() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/fencegate.toml");
    let text = std::fs::read_to_string(path).unwrap();
    let file: toml::Table = text.parse().unwrap();
    let defaults = toml::Table::try_from(Config::default()).unwrap();
    for (section, value) in &defaults {
        assert!(file.contains_key(section), "{section} is not in the file");
        if let (Some(d), Some(f)) = (value.as_table(), file[section].as_table()) {
            for key in d.keys() {
                assert!(f.contains_key(key), "{section}.{key} is not in the file");
            }
        }
    }
}

#[test]
fn every_example_config_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(Some(&path), Vec::new(), &Overrides::default())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen >= 3, "only {seen} examples");
}
