//! `strftime_now(fmt)` for chat templates: Hugging Face defines it as
//! `datetime.now().strftime(fmt)`, i.e. local wall-clock time, naive (so `%z`
//! and `%Z` print nothing), C-locale names. Local time comes from the C
//! library's `localtime_r` on 64-bit Unix; elsewhere we fall back to UTC.

use std::time::{SystemTime, UNIX_EPOCH};

/// A broken-down local time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub micros: u32,
    /// 0 = Sunday
    pub weekday: u32,
    /// 0-based day of the year
    pub yday: u32,
    /// Seconds since the Unix epoch.
    pub epoch: i64,
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March-based
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn day_of_year(year: i64, month: u32, day: u32) -> u32 {
    const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let mut d = CUM[(month - 1) as usize] + day - 1;
    if month > 2 && is_leap(year) {
        d += 1;
    }
    d
}

impl DateTime {
    /// UTC broken-down time for `epoch` seconds plus `micros`.
    pub fn utc(epoch: i64, micros: u32) -> Self {
        let days = epoch.div_euclid(86_400);
        let secs = epoch.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        DateTime {
            year,
            month,
            day,
            hour: secs / 3600,
            minute: secs / 60 % 60,
            second: secs % 60,
            micros,
            weekday: (days + 4).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
            yday: day_of_year(year, month, day),
            epoch,
        }
    }

    /// The current local time.
    pub fn now_local() -> Self {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let epoch = now.as_secs() as i64;
        let micros = now.subsec_micros();
        local_time(epoch, micros).unwrap_or_else(|| DateTime::utc(epoch, micros))
    }
}

#[cfg(all(unix, target_pointer_width = "64"))]
fn local_time(epoch: i64, micros: u32) -> Option<DateTime> {
    use std::os::raw::{c_char, c_int, c_long};
    // `struct tm` as laid out by glibc, musl and the BSDs/macOS on 64-bit
    // targets; the padding leaves room should a libc append private fields.
    #[repr(C)]
    struct Tm {
        tm_sec: c_int,
        tm_min: c_int,
        tm_hour: c_int,
        tm_mday: c_int,
        tm_mon: c_int,
        tm_year: c_int,
        tm_wday: c_int,
        tm_yday: c_int,
        tm_isdst: c_int,
        tm_gmtoff: c_long,
        tm_zone: *const c_char,
        _reserved: [u64; 8],
    }
    extern "C" {
        fn localtime_r(timep: *const i64, result: *mut Tm) -> *mut Tm;
    }
    // SAFETY: `Tm` is a zeroable POD at least as large as the C struct, and
    // localtime_r only writes into the buffer we pass.
    let mut tm: Tm = unsafe { std::mem::zeroed() };
    let t: i64 = epoch;
    let r = unsafe { localtime_r(&t, &mut tm) };
    if r.is_null() {
        return None;
    }
    let month = (tm.tm_mon + 1) as u32;
    if !(1..=12).contains(&month) {
        return None;
    }
    Some(DateTime {
        year: i64::from(tm.tm_year) + 1900,
        month,
        day: tm.tm_mday as u32,
        hour: tm.tm_hour as u32,
        minute: tm.tm_min as u32,
        second: tm.tm_sec as u32,
        micros,
        weekday: tm.tm_wday as u32,
        yday: tm.tm_yday as u32,
        epoch,
    })
}

#[cfg(not(all(unix, target_pointer_width = "64")))]
fn local_time(_epoch: i64, _micros: u32) -> Option<DateTime> {
    None
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// ISO 8601 (year, week) of a date.
fn iso_week(dt: &DateTime) -> (i64, u32) {
    let wday_mon = (dt.weekday + 6) % 7; // Monday = 0
    let yday = dt.yday as i64;
    // Thursday of this week decides the ISO year.
    let thursday = yday - wday_mon as i64 + 3;
    let year_len = |y: i64| if is_leap(y) { 366 } else { 365 };
    if thursday < 0 {
        let prev = dt.year - 1;
        let t = thursday + year_len(prev);
        (prev, (t / 7 + 1) as u32)
    } else if thursday >= year_len(dt.year) {
        (dt.year + 1, 1)
    } else {
        (dt.year, (thursday / 7 + 1) as u32)
    }
}

/// Formats `dt` with C-locale `strftime` directives (plus Python's `%f`).
/// glibc's `-` (no padding) and `_` (space padding) flags are honoured;
/// unknown directives are copied through unchanged.
pub(crate) fn format(dt: &DateTime, fmt: &str) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut flag = None;
        if let Some(&f) = chars.peek() {
            if f == '-' || f == '_' || f == '0' {
                flag = Some(f);
                chars.next();
            }
        }
        let Some(d) = chars.next() else {
            out.push('%');
            if let Some(f) = flag {
                out.push(f);
            }
            break;
        };
        // Numeric field with default width and pad character.
        let num = |out: &mut String, v: i64, width: usize, pad: char| {
            let pad = match flag {
                Some('-') => None,
                Some('_') => Some(' '),
                Some('0') => Some('0'),
                _ => Some(pad),
            };
            let s = v.abs().to_string();
            if v < 0 {
                out.push('-');
            }
            if let Some(p) = pad {
                for _ in s.len()..width {
                    out.push(p);
                }
            }
            out.push_str(&s);
        };
        let hour12 = match dt.hour % 12 {
            0 => 12,
            h => h,
        };
        match d {
            'a' => out.push_str(&DAYS[dt.weekday as usize % 7][..3]),
            'A' => out.push_str(DAYS[dt.weekday as usize % 7]),
            'b' | 'h' => out.push_str(&MONTHS[(dt.month - 1) as usize][..3]),
            'B' => out.push_str(MONTHS[(dt.month - 1) as usize]),
            'c' => out.push_str(&format(dt, "%a %b %e %H:%M:%S %Y")),
            'C' => num(&mut out, dt.year.div_euclid(100), 2, '0'),
            'd' => num(&mut out, dt.day.into(), 2, '0'),
            'D' | 'x' => out.push_str(&format(dt, "%m/%d/%y")),
            'e' => num(&mut out, dt.day.into(), 2, ' '),
            'f' => num(&mut out, dt.micros.into(), 6, '0'),
            'F' => out.push_str(&format(dt, "%Y-%m-%d")),
            'G' => num(&mut out, iso_week(dt).0, 4, '0'),
            'g' => num(&mut out, iso_week(dt).0.rem_euclid(100), 2, '0'),
            'H' => num(&mut out, dt.hour.into(), 2, '0'),
            'I' => num(&mut out, hour12.into(), 2, '0'),
            'j' => num(&mut out, (dt.yday + 1).into(), 3, '0'),
            'k' => num(&mut out, dt.hour.into(), 2, ' '),
            'l' => num(&mut out, hour12.into(), 2, ' '),
            'm' => num(&mut out, dt.month.into(), 2, '0'),
            'M' => num(&mut out, dt.minute.into(), 2, '0'),
            'n' => out.push('\n'),
            'p' => out.push_str(if dt.hour < 12 { "AM" } else { "PM" }),
            'P' => out.push_str(if dt.hour < 12 { "am" } else { "pm" }),
            'r' => out.push_str(&format(dt, "%I:%M:%S %p")),
            'R' => out.push_str(&format(dt, "%H:%M")),
            's' => num(&mut out, dt.epoch, 1, '0'),
            'S' => num(&mut out, dt.second.into(), 2, '0'),
            't' => out.push('\t'),
            'T' | 'X' => out.push_str(&format(dt, "%H:%M:%S")),
            'u' => num(
                &mut out,
                (if dt.weekday == 0 { 7 } else { dt.weekday }).into(),
                1,
                '0',
            ),
            'U' => num(&mut out, ((dt.yday + 7 - dt.weekday) / 7).into(), 2, '0'),
            'V' => num(&mut out, iso_week(dt).1.into(), 2, '0'),
            'w' => num(&mut out, dt.weekday.into(), 1, '0'),
            'W' => num(
                &mut out,
                ((dt.yday + 7 - (dt.weekday + 6) % 7) / 7).into(),
                2,
                '0',
            ),
            'y' => num(&mut out, dt.year.rem_euclid(100), 2, '0'),
            'Y' => num(&mut out, dt.year, 1, '0'),
            // datetime.now() is naive: no offset, no zone name.
            'z' | 'Z' => {}
            '%' => out.push('%'),
            other => {
                out.push('%');
                if let Some(f) = flag {
                    out.push(f);
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_breakdown_and_format() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let dt = DateTime::utc(1_721_999_109, 42);
        assert_eq!((dt.year, dt.month, dt.day), (2024, 7, 26));
        assert_eq!((dt.hour, dt.minute, dt.second, dt.weekday), (13, 5, 9, 5));
        assert_eq!(format(&dt, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format(&dt, "%A, %B %-d %Y %I:%M %p %j"),
            "Friday, July 26 2024 01:05 PM 208"
        );
        assert_eq!(
            format(&dt, "%F %T.%f%z%Z %%"),
            "2024-07-26 13:05:09.000042 %"
        );
        assert_eq!(format(&dt, "%G-W%V-%u"), "2024-W30-5");
        // 2021-01-01 belongs to ISO week 53 of 2020.
        let dt = DateTime::utc(1_609_459_200, 0);
        assert_eq!(
            format(&dt, "%Y-%m-%d %G %V %U %W"),
            "2021-01-01 2020 53 00 00"
        );
        // Leap day.
        let dt = DateTime::utc(951_782_400, 0);
        assert_eq!(format(&dt, "%Y-%m-%d %j"), "2000-02-29 060");
    }

    #[test]
    fn local_now_is_sane() {
        let dt = DateTime::now_local();
        assert!(dt.year >= 2024 && (1..=12).contains(&dt.month) && (1..=31).contains(&dt.day));
    }
}
