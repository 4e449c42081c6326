"""softq.mpc"""
