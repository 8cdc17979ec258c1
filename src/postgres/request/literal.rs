//! Statements sent as a simple query, which has no parameters: the key's
//! values (and a setting) are written into the text as literals. Numbers
//! are quoted literals, text is its UTF-8 bytes in hex, decoded by the
//! server, so nothing the caller chose is ever read as SQL, whatever the
//! session's `standard_conforming_strings`.

use crate::postgres::request::key::Bound;

/// The key's `$1`, `$2` and `$3` as literals.
pub(crate) fn key_literals(key: Bound<'_>) -> [String; 3] {
    let (space, value, name) = key.values();
    [
        format!("'{space}'"),
        value.map_or_else(|| "NULL".to_owned(), |value| format!("'{value}'")),
        name.map_or_else(|| "NULL".to_owned(), text_literal),
    ]
}

/// `text` as an expression of type `text` that the server decodes.
pub(crate) fn text_literal(text: &str) -> String {
    format!(
        "pg_catalog.convert_from(pg_catalog.decode('{}', 'hex'), 'UTF8')",
        hex::encode(text)
    )
}

/// `sql`, a statement that binds the key as `$1`–`$3` and optionally a text
/// as `$4`, with those written in as literals. `sql` is one of the crate's
/// own statements, which have no `$` beyond their parameters.
pub(crate) fn with_literals(sql: &str, key: Bound<'_>, fourth: Option<&str>) -> String {
    let [space, value, name] = key_literals(key);
    let mut text = sql
        .replace("$1", &space)
        .replace("$2", &value)
        .replace("$3", &name);
    if let Some(fourth) = fourth {
        text = text.replace("$4", &text_literal(fourth));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockKey;

    #[test]
    fn a_name_is_written_as_hex_and_every_parameter_is_replaced() {
        let key = LockKey::from("it's; DROP TABLE x; --");
        let args = key.args().expect("a valid key");
        let sql = with_literals(
            "SELECT $1::int4, $2::int8, $3::text, $4",
            args.into(),
            Some("1'ms"),
        );
        assert!(!sql.contains("DROP") && !sql.contains('$'), "{sql}");
        assert!(
            sql.contains(&hex::encode("it's; DROP TABLE x; --")),
            "{sql}"
        );
        assert!(sql.contains(&hex::encode("1'ms")), "{sql}");
        assert!(sql.starts_with("SELECT '1'::int4, NULL::int8"), "{sql}");
    }
}
