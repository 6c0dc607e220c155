//! The advisory key of a lock key, computed in process exactly as the
//! server computes `hashtextextended(key, seed)`: PostgreSQL's
//! `hash_bytes_extended` (Bob Jenkins' lookup3, seeded with 64 bits) over
//! the key's UTF-8 bytes, which are its bytes on a server whose encoding is
//! UTF-8.
//!
//! A lock session uses it to know, before a lock statement is sent, which
//! other statements and leases on the session share its advisory key (see
//! `LockSession::already_holds`). The server's own answer stays the
//! advisory key a lease holds. A key outside ASCII has other bytes on a
//! server whose encoding is not UTF-8, and its advisory key is then known
//! only from the server; a session whose server hashes a probe otherwise
//! computes none (see `LockSession::advisory_key_of`).

/// What a new lock session hashes on the server and in process, to see
/// that both agree. ASCII, which every server encoding has: keys outside
/// ASCII are computed in process only on a server whose encoding is UTF-8.
pub(super) const PROBE: &str = "dlock probe: the advisory key of a lock key";

/// `hashtextextended(key, seed)` for a server whose encoding is UTF-8.
pub(super) fn advisory_key(key: &str, seed: i64) -> i64 {
    let bytes = key.as_bytes();
    // The server hashes at most i32::MAX bytes; a lock key is far shorter.
    let init = 0x9e37_79b9_u32
        .wrapping_add(bytes.len() as u32)
        .wrapping_add(3_923_095);
    let mut s = [init; 3];
    if seed != 0 {
        let seed = seed as u64;
        s[0] = s[0].wrapping_add((seed >> 32) as u32);
        s[1] = s[1].wrapping_add(seed as u32);
        mix(&mut s);
    }
    let mut blocks = bytes.chunks_exact(12);
    for block in &mut blocks {
        for (word, chunk) in s.iter_mut().zip(block.chunks_exact(4)) {
            *word = word.wrapping_add(u32::from_le_bytes(chunk.try_into().expect("4 bytes")));
        }
        mix(&mut s);
    }
    // The last 0 to 11 bytes, little-endian into a and b; c's lowest byte
    // is left out, so the tail fills c from its second byte on.
    for (i, &byte) in blocks.remainder().iter().enumerate() {
        let (word, shift) = if i < 8 { (i / 4, i % 4) } else { (2, i - 7) };
        s[word] = s[word].wrapping_add(u32::from(byte) << (8 * shift));
    }
    finish(&mut s);
    ((u64::from(s[1]) << 32) | u64::from(s[2])) as i64
}

fn mix(s: &mut [u32; 3]) {
    let [mut a, mut b, mut c] = *s;
    a = a.wrapping_sub(c) ^ c.rotate_left(4);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a) ^ a.rotate_left(6);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b) ^ b.rotate_left(8);
    b = b.wrapping_add(a);
    a = a.wrapping_sub(c) ^ c.rotate_left(16);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a) ^ a.rotate_left(19);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b) ^ b.rotate_left(4);
    b = b.wrapping_add(a);
    *s = [a, b, c];
}

fn finish(s: &mut [u32; 3]) {
    let [mut a, mut b, mut c] = *s;
    c = (c ^ b).wrapping_sub(b.rotate_left(14));
    a = (a ^ c).wrapping_sub(c.rotate_left(11));
    b = (b ^ a).wrapping_sub(a.rotate_left(25));
    c = (c ^ b).wrapping_sub(b.rotate_left(16));
    a = (a ^ c).wrapping_sub(c.rotate_left(4));
    b = (b ^ a).wrapping_sub(a.rotate_left(14));
    c = (c ^ b).wrapping_sub(b.rotate_left(24));
    *s = [a, b, c];
}

#[cfg(test)]
mod tests {
    use super::advisory_key;

    /// Values PostgreSQL gave for `hashtextextended(key, seed)`.
    #[test]
    fn matches_the_servers_hashtextextended() {
        let known: &[(&str, i64, i64)] = &[
            ("", 0, -6939563903564495251),
            ("", 1, -150071773020461347),
            ("", -1, -5142811166230430645),
            ("", 9223372036854775807, -4298248173090169092),
            ("", -7046029254386353131, 5233101233904376371),
            ("a", 0, 3591986179850072241),
            ("a", 1, 3325245193489759299),
            ("a", -1, 8688456822845412000),
            ("a", 9223372036854775807, -4948564415594343765),
            ("a", -7046029254386353131, -7773757010039246667),
            ("ab", 0, 2833316173711343549),
            ("ab", 1, 6831083245906393158),
            ("ab", -1, 3639176434904646991),
            ("ab", 9223372036854775807, -3624711498925237321),
            ("ab", -7046029254386353131, -8813337557218265245),
            ("abc", 0, -6747756470228489321),
            ("abc", 1, 2125675926272891485),
            ("abc", -1, 1911237551546830967),
            ("abc", 9223372036854775807, 8851712801786142035),
            ("abc", -7046029254386353131, 7179462710890291301),
            ("abcd", 0, -1038429303365892052),
            ("abcd", 1, -9042268383291675265),
            ("abcd", -1, -8506387423880103258),
            ("abcd", 9223372036854775807, -4393227063995791472),
            ("abcd", -7046029254386353131, 3344324032684639052),
            ("abcde", 0, 3076356108696143428),
            ("abcde", 1, 3336351395796527909),
            ("abcde", -1, 1101614911744638770),
            ("abcde", 9223372036854775807, 140345642306784946),
            ("abcde", -7046029254386353131, 5423556707833176642),
            ("abcdefg", 0, -6158032784613548338),
            ("abcdefg", 1, 8893296306369806751),
            ("abcdefg", -1, 6620770052711690062),
            ("abcdefg", 9223372036854775807, 8092175030054910351),
            ("abcdefg", -7046029254386353131, -3749399259217886742),
            ("abcdefgh", 0, -8882191227074733005),
            ("abcdefgh", 1, -996835456672934620),
            ("abcdefgh", -1, 3589487173844465705),
            ("abcdefgh", 9223372036854775807, 4029779553967995786),
            ("abcdefgh", -7046029254386353131, 5150498316399276286),
            ("abcdefghi", 0, -3278210106038014113),
            ("abcdefghi", 1, 5773402991589158274),
            ("abcdefghi", -1, -2999851607155231060),
            ("abcdefghi", 9223372036854775807, -2574806882761931857),
            ("abcdefghi", -7046029254386353131, 5389185136993292524),
            ("abcdefghij", 0, -3183301415634409076),
            ("abcdefghij", 1, 3861069368272743232),
            ("abcdefghij", -1, -5021275161817138704),
            ("abcdefghij", 9223372036854775807, -1961018437899898272),
            ("abcdefghij", -7046029254386353131, -7217590788827204809),
            ("abcdefghijk", 0, 3112909444737856467),
            ("abcdefghijk", 1, 8196382510784792041),
            ("abcdefghijk", -1, 2833918571160852060),
            ("abcdefghijk", 9223372036854775807, 2145874302060842752),
            ("abcdefghijk", -7046029254386353131, -802576794447761230),
            ("abcdefghijkl", 0, -7556637188122330412),
            ("abcdefghijkl", 1, -6429754808531195817),
            ("abcdefghijkl", -1, -3669402583748189229),
            ("abcdefghijkl", 9223372036854775807, -7405302416993488311),
            ("abcdefghijkl", -7046029254386353131, 7075027150287853142),
            ("abcdefghijklm", 0, 8871624171452417744),
            ("abcdefghijklm", 1, 3808842878744369845),
            ("abcdefghijklm", -1, 6205390682044465928),
            ("abcdefghijklm", 9223372036854775807, -4348500005650857607),
            ("abcdefghijklm", -7046029254386353131, 7177256405767785247),
            ("dlock:export:42", 0, 2473374511424992910),
            ("dlock:export:42", 1, 2813245978713032821),
            ("dlock:export:42", -1, 4990145005961426968),
            ("dlock:export:42", 9223372036854775807, -1477726055922251955),
            ("dlock:export:42", -7046029254386353131, 8052587691089103682),
            ("größe/ключ/键", 0, -5141150881372454326),
            ("größe/ключ/键", 1, 6490376213945195456),
            ("größe/ключ/键", -1, -2516244192788956850),
            ("größe/ключ/键", 9223372036854775807, 6905587824588043129),
            ("größe/ключ/键", -7046029254386353131, -8379714971920496125),
            (
                "0123456789abcdefghijklmnopqrstuvwxyz",
                0,
                2599983508539421163,
            ),
            (
                "0123456789abcdefghijklmnopqrstuvwxyz",
                1,
                -2406378843534258124,
            ),
            (
                "0123456789abcdefghijklmnopqrstuvwxyz",
                -1,
                -7850584439365358655,
            ),
            (
                "0123456789abcdefghijklmnopqrstuvwxyz",
                9223372036854775807,
                -3945084032221809594,
            ),
            (
                "0123456789abcdefghijklmnopqrstuvwxyz",
                -7046029254386353131,
                4155149553765060821,
            ),
        ];
        for &(key, seed, expected) in known {
            assert_eq!(advisory_key(key, seed), expected, "{key:?} seed {seed}");
        }
    }
}
