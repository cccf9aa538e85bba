//! The README's promises to a newcomer: the `[dependencies]` snippet names versions this
//! build satisfies, and the re-exported crates are the ones dacapo's API is written with.
#![cfg(feature = "sqlite")]

/// The `[dependencies]` block of the README's first `toml` code block, as (name, spec) lines.
fn readme_dependencies() -> Vec<(String, String)> {
    let readme = include_str!("../README.md");
    let start = readme
        .find("```toml\n[dependencies]\n")
        .expect("a [dependencies] snippet");
    let block = &readme[start + "```toml\n[dependencies]\n".len()..];
    let block = &block[..block.find("```").expect("the snippet ends")];
    block
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let (name, spec) = line.split_once('=').expect("name = spec");
            (name.trim().to_owned(), spec.trim().to_owned())
        })
        .collect()
}

/// The `version = "…"` (or bare `"…"`) requirement of a dependency line.
fn version_of(spec: &str) -> Option<&str> {
    let spec = spec.split('#').next().unwrap_or(spec).trim();
    if let Some(bare) = spec.strip_prefix('"') {
        return bare.split('"').next();
    }
    let at = spec.find("version = \"")? + "version = \"".len();
    spec[at..].split('"').next()
}

/// Whether requirement `wanted` (a caret requirement such as `1` or `0.3`) accepts `have`
/// (such as `1.40` or `0.3.19`): same first non-zero component, `have` at or above it.
fn compatible(wanted: &str, have: &str) -> bool {
    let parse = |v: &str| -> Vec<u64> { v.split('.').filter_map(|n| n.parse().ok()).collect() };
    let (wanted, have) = (parse(wanted), parse(have));
    let significant = wanted.iter().position(|&n| n != 0).unwrap_or(0);
    wanted[..=significant] == have[..=significant.min(have.len() - 1)]
        && have.iter().zip(&wanted).all(|(h, w)| h >= w)
}

#[test]
fn the_dependency_snippet_asks_for_versions_this_build_uses() {
    let manifest = include_str!("../Cargo.toml");
    let ours = |name: &str| -> String {
        let line = manifest
            .lines()
            .find(|l| l.starts_with(&format!("{name} = ")))
            .unwrap_or_else(|| panic!("{name} is a workspace dependency"));
        version_of(line.split_once('=').unwrap().1)
            .unwrap()
            .to_owned()
    };
    let dependencies = readme_dependencies();
    let names: Vec<_> = dependencies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["dacapo", "serde", "tokio", "tracing-subscriber"]);
    for (name, spec) in &dependencies {
        if name == "dacapo" {
            assert!(spec.contains("path = "), "{spec}");
            continue;
        }
        let wanted = version_of(spec).unwrap();
        let have = ours(name);
        assert!(
            compatible(wanted, &have),
            "the README asks for {name} {wanted}; dacapo builds with {have}"
        );
    }
}

#[test]
fn version_requirements_are_compared_as_cargo_does() {
    assert!(compatible("1", "1.40"));
    assert!(compatible("0.3", "0.3"));
    assert!(!compatible("0.8", "0.9"));
    assert!(!compatible("2", "1.40"));
    assert!(!compatible("1.41", "1.40"));
}

#[tokio::test]
async fn the_reexported_crates_are_the_ones_in_dacapos_signatures() {
    // Each line only compiles if the re-export is the very crate the API uses.
    let store = dacapo::store::SqliteStore::open("sqlite::memory:")
        .await
        .unwrap();
    let pool: &dacapo::sqlx::SqlitePool = store.pool();
    let one: i64 = dacapo::sqlx::query_scalar("SELECT 1")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(one, 1);
    let envelope = dacapo::Envelope::new("t", b"{}".to_vec());
    let id: dacapo::uuid::Uuid = envelope.id;
    let _: dacapo::chrono::DateTime<dacapo::chrono::Utc> = envelope.sent_at;
    let _: dacapo::serde_json::Value = dacapo::serde_json::from_slice(&envelope.payload).unwrap();
    assert!(!id.is_nil());
}

#[tokio::test]
async fn an_applications_query_error_converts_with_a_question_mark() {
    async fn insert_twice(pool: &dacapo::sqlx::SqlitePool) -> Result<(), dacapo::Error> {
        dacapo::sqlx::query("CREATE TABLE t (id INTEGER PRIMARY KEY)")
            .execute(pool)
            .await?;
        for _ in 0..2 {
            dacapo::sqlx::query("INSERT INTO t (id) VALUES (1)")
                .execute(pool)
                .await?;
        }
        Ok(())
    }
    let store = dacapo::store::SqliteStore::open("sqlite::memory:")
        .await
        .unwrap();
    let error = insert_twice(store.pool()).await.unwrap_err();
    assert!(matches!(error, dacapo::Error::Rejected(_)), "{error}");
    assert!(!error.is_retryable());
}
