#!/usr/bin/env python3
"""Ranges over bench runs, as BENCHMARKS.md reports them.

Usage: python3 docs/bench/summarize.py docs/bench/runs/run-12.md docs/bench/runs/run-13.md ...
Prints, per section, each ratio or median as "min-max (med m)" over the runs given:
the interleaved cycles and where their time goes, the back-to-back cycles (loopback,
current-thread, 0.5 ms), hand-offs, lock kinds and many keys."""
import sys,re
def tables(path):
    sec=None; out={}
    for line in open(path):
        line=line.rstrip('\n')
        if line.startswith('#'):
            sec=line.strip('# ').strip()
            continue
        if line.startswith('|') and not line.startswith('|---') and not re.match(r'^\|\s*-',line):
            cells=[c.strip() for c in line.strip('|').split('|')]
            out.setdefault(sec,[]).append(cells)
    return out
def num(s):
    s=s.replace(',','').replace('×','').replace('µs','').strip()
    try: return float(s)
    except: return None
runs=sys.argv[1:]
res={}
for r in runs:
    t=tables(r); m={}
    for sec,key in [('Uncontended cycle (one task, one free key)','loop'),('The same cycles on a current-thread tokio runtime','ct'),('The same cycles over a 0.5 ms round-trip link (delaying proxy)','net')]:
        rows={row[0]:row for row in t.get(sec,[]) if len(row)>3}
        med=lambda n: num(rows[n][1]) if n in rows else None
        pg=med('sqlx PgAdvisoryLock'); hw=med('sqlx hand-written BEGIN / try / COMMIT')
        d=med('distlock try_lock+release')
        m[key]=dict(
          xact=med('distlock with_advisory_lock')/hw, xactcold=med('distlock with_advisory_lock, keep_warm(0)')/hw,
          sesscold=med('distlock try_lock+release, keep_warm(0)')/pg, xactcaller=med('distlock try_lock_xact in the caller\'s BEGIN / COMMIT')/hw,
          sess=d/pg, mux=med('distlock multiplexed try_lock+release')/pg, fenced=med('distlock try_lock+release, fencing on')/d,
          shared=med('distlock try_lock_shared+release')/pg, sem=med('distlock Semaphore(4) try_acquire+release')/pg,
          all1=med('distlock try_lock_all(1 key)+release')/pg, all4=med('distlock try_lock_all(4 keys)+release')/pg, all16=med('distlock try_lock_all(16 keys)+release')/pg,
          table=med('distlock TableLocker try_lock+release'), tablevslease=med('distlock TableLocker try_lock+release')/med('sqlx hand-written INSERT ON CONFLICT lease + DELETE'),
          tablevspg=med('distlock TableLocker try_lock+release')/pg, lease=med('sqlx hand-written INSERT ON CONFLICT lease + DELETE'),
          xactus=med('distlock with_advisory_lock'), xactcallerus=med('distlock try_lock_xact in the caller\'s BEGIN / COMMIT'), sessus=d, fencedus=med('distlock try_lock+release, fencing on'), muxus=med('distlock multiplexed try_lock+release'))
    ho={}
    for row in t.get('Contended hand-off (release → next holder), one hot key',[]):
        if len(row)>=8 and row[0].isdigit():
            ho[(row[0],row[1])]=(num(row[7]),num(row[3]))
    m['ho']=ho
    k={}
    for row in t.get('Lock kinds: hand-over latencies',[]):
        if len(row)>=6: k[row[0]]=(row[3],row[4],row[5])
    m['kinds']=k
    many={}
    for row in t.get('Many keys held at once by one process',[]):
        if len(row)>=3 and row[0]=='10000': many[row[1]]=num(row[2])
    m['many']=many
    # The interleaved cycles (the headline): each alternative's median and
    # its ratios to PgAdvisoryLock and to its hand-written counterpart.
    for sec,key in [('Multi-thread runtime','imt'),('Current-thread runtime','ict')]:
        rows={row[0]:row for row in t.get(sec,[]) if len(row)>4 and row[0]!='alternative'}
        m[key]={name:(num(row[1]),num(row[3]),num(row[4])) for name,row in rows.items()}
        d=rows.get('distlock try_lock+release'); f=rows.get('distlock try_lock+release, fencing on')
        m[key+'fenced']=num(f[1])/num(d[1]) if d and f else None
    m['cold']={row[0]:(num(row[1]),num(row[2])) for row in t.get('Where an interleaved cycle\'s time goes (current-thread runtime)',[]) if len(row)>=3 and row[0]!='step'}
    res[r]=m
def rng(vals,fmt='{:.2f}'):
    vals=[v for v in vals if v is not None]
    # No figure in any run (the Redis hand-off rows have no pgbench ratio, '–'):
    # say so rather than stop the summary there.
    if not vals: return '–'
    vals.sort()
    med=vals[len(vals)//2]
    return (fmt+'–'+fmt+' (med '+fmt+')').format(vals[0],vals[-1],med)
for key,name in [('imt','interleaved, multi-thread'),('ict','interleaved, current-thread')]:
    print('==',name,': median µs | vs PgAdvisoryLock | vs hand-written')
    for alt in res[runs[0]][key]:
        get=lambda r,i: res[r][key].get(alt,(None,None,None))[i]
        print(alt,'|',rng([get(r,0) for r in runs],'{:.0f}'),'|',rng([get(r,1) for r in runs]),'|',rng([get(r,2) for r in runs]))
    print('fenced vs unfenced', rng([res[r][key+'fenced'] for r in runs]))
print('== where an interleaved cycle\'s time goes: after 1 ms idle | right after another round trip, µs')
for step in res[runs[0]]['cold']:
    get=lambda r,i: res[r]['cold'].get(step,(None,None))[i]
    print(step,'|',rng([get(r,0) for r in runs],'{:.0f}'),'|',rng([get(r,1) for r in runs],'{:.0f}'))
for key in ['loop','ct','net']:
    print('==',key)
    for f in res[runs[0]][key]:
        print(f, rng([res[r][key][f] for r in runs], '{:.2f}' if 'us' not in f and f not in ('table','lease') else '{:.0f}'))
print('== handoff (vs pgbench, p99)')
# A row missing from a run counts as no figure there.
ho=lambda r,k,i: res[r]['ho'].get(k,(None,None))[i]
for k in res[runs[0]]['ho']:
    print(k, rng([ho(r,k,0) for r in runs]), 'p99', rng([ho(r,k,1) for r in runs],'{:.0f}'))
print('== kinds')
for r in runs: print(r, res[r]['kinds'])
print('== many')
for r in runs: print(r, res[r]['many'])
